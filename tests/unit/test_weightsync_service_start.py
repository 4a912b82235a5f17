"""A weightsync service reports SERVING only once the codec kernels it runs are loaded
(numba loads each from its on-disk cache at its first call): checked in a fresh
interpreter, where nothing loaded them before."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import asyncio, json, sys
from services.weightsync.codec import index_kernels
from services.weightsync.config import WeightSyncConfig
from services.weightsync.server import WeightSyncService

kernels = {k: getattr(index_kernels, k) for k in ("_encode_v3", "_decode_chunk3", "_build_index")}
service = WeightSyncService(WeightSyncConfig(data_dir=sys.argv[1]))
before = {k: len(f.overloads) for k, f in kernels.items()}

async def start_and_stop():
    await service.start()  # what run_server awaits before it reports SERVING
    after = {k: len(f.overloads) for k, f in kernels.items()}
    await service.stop()
    return after

print(json.dumps({"before": before, "after": asyncio.run(start_and_stop())}))
"""


def test_a_started_service_has_loaded_its_encode_and_decode_kernels(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "data")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(n == 0 for n in loaded["before"].values())  # a fresh interpreter: the check means something
    # Both word sizes (16-bit dtypes, fp32) of the origin's encoder and the receiver's decoder and index build.
    assert all(n >= 2 for n in loaded["after"].values()), loaded
