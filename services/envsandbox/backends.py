"""Chooses a sandbox backend from the configuration."""
from __future__ import annotations

import tempfile
from pathlib import Path

from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.sandbox import Backend


def make_backend(config: EnvSandboxConfig) -> Backend:
    """The backend named by ``config.backend`` (imports the Docker SDK only when asked)."""
    root = Path(config.root) if config.root else Path(tempfile.mkdtemp(prefix="meridian-sandboxes-"))
    if config.backend == "docker":
        from services.envsandbox.docker_backend import DockerBackend

        return DockerBackend(root=root, base_url=config.docker_host, image=config.docker_image)
    from services.envsandbox.process_backend import ProcessBackend

    return ProcessBackend(root=root)
