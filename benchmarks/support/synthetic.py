"""Fixed, reproducible trajectories built from a model's tokenizer ids, for the trainer's
benchmark and its recovery tests: same inputs every run, so two runs of the trainer
can be compared weight for weight."""
from __future__ import annotations

import random
from pathlib import Path

from meridian.v1 import common_pb2

PROMPTS = (
    "Write a Python function `add(a, b)` that returns the sum of a and b.",
    "Write a Python function `square(x)` that returns x squared.",
    "Write a Python function `is_even(n)` that returns True when n is even.",
    "Write a Python function `last_element(xs)` that returns the last item of xs.",
)
COMPLETIONS = (
    "def add(a, b):\n    return a + b\n",
    "def square(x):\n    return x * x\n",
    "def is_even(n):\n    return n % 2 == 0\n",
    "def last_element(xs):\n    return xs[-1]\n",
    "I am not sure how to do that.",
)


def fixed_groups(
    model_dir: Path,
    groups: int,
    group_size: int = 2,
    seed: int = 0,
    versions: list[int] | None = None,
    flat_every: int = 0,
    completion_tokens: int = 0,
    system_prompt: str | None = None,
) -> list[list[common_pb2.Trajectory]]:
    """``groups`` GRPO groups of real tokenizer ids with deterministic rewards and log-probs.

    ``versions[i]`` is the policy version of group i's tokens (default 0). Every
    ``flat_every``-th group gets equal rewards (0: none). Completions carry a masked
    tool-output span, as real episodes do. ``completion_tokens`` > 0 pads or cuts each
    completion to that many tokens (benchmarks want a fixed shape). With ``system_prompt``
    each prompt is a chat (that system message, the instruction as the user's) through
    the model's chat template, the shape of a real episode's prompt.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    if system_prompt is None:
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
    else:
        chats = [[{"role": "system", "content": system_prompt}, {"role": "user", "content": p}] for p in PROMPTS]
        prompts = [list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for chat in chats]
    answers = [tokenizer(c).input_ids for c in COMPLETIONS]
    tool = tokenizer("\n[tool] ok\n").input_ids
    out: list[list[common_pb2.Trajectory]] = []
    for g in range(groups):
        prompt = prompts[g % len(prompts)]
        flat = flat_every > 0 and (g + 1) % flat_every == 0
        version = versions[g] if versions else 0
        members = []
        for m in range(group_size):
            answer = answers[rng.randrange(len(answers))]
            completion = [*answer[: len(answer) // 2], *tool, *answer[len(answer) // 2 :]]
            mask = [1] * (len(answer) // 2) + [0] * len(tool) + [1] * (len(answer) - len(answer) // 2)
            if completion_tokens:
                filler = answers[0] * (completion_tokens // max(1, len(answers[0])) + 1)
                completion = (completion + filler)[:completion_tokens]
                mask = (mask + [1] * len(filler))[:completion_tokens]
            members.append(
                common_pb2.Trajectory(
                    trajectory_id=f"traj-{seed}-{g}-{m}",
                    task_id=f"synthetic/{g % len(prompts)}",
                    group_id=f"group-{seed}-{g}",
                    group_size=group_size,
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    logprobs=[round(-rng.uniform(0.05, 3.0), 4) if k else 0.0 for k in mask],
                    loss_mask=mask,
                    policy_versions=[version if k else -1 for k in mask],
                    reward=0.5 if flat else float((m + g) % 2),
                    finish_reason="stop",
                    model="synthetic",
                )
            )
        out.append(members)
    return out
