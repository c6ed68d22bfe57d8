"""What llama-server computes when it cuts back a state restored from its `--cache-ram` past a sliding window.

A state saved with `llama_state_seq_get_data` holds only the last window of a sliding-window layer's positions (the
cells its last position no longer attends to are skipped), even with `--swa-full`. kvroute cuts such a state back
only within its last token or to a checkpoint (docs/models.md); llama-server (`--swa-full`: it then treats the
model as having no window) cuts it anywhere. This probe sends one llama-server with one slot the same prompt C after
two histories: once cut back from the slot itself (every position held), once from a state restored from its host
RAM (the same cut, the same new tokens in the same batch), and prints the first logprobs of each. Equal logprobs
would mean the restored cut is exact; different ones, that its window has holes.

    .venv/bin/python -m bench.swa_cut_probe
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import httpx

from bench.systems import Server, Setup
from bench.trace_replay import WORDS
from common.model import default_model_path


def main() -> None:
    rng = random.Random(5)
    history = " ".join(rng.choice(WORDS) for _ in range(900))  # ~1,000 tokens: longer than Gemma 3's 512 window
    question = " question: " + " ".join(rng.choice(WORDS) for _ in range(40))
    prompt = history[: len(history) - 60] + question  # shares all of the history but its last ~12 tokens
    # the harness's llama-server (bench/systems.py: --swa-full --cache-ram 2048), one slot of 4,096 tokens
    setup = Setup(str(default_model_path()), threads=2, workers=1, slots=1, ctx_per_slot=4096)
    with (
        tempfile.TemporaryDirectory() as tmp,
        Server("llama-server", setup, Path(tmp) / "log") as server,
        httpx.Client(timeout=600) as http,
    ):

        def complete(text: str, n: int = 8) -> tuple[int, list[float]]:
            body = {"prompt": text, "n_predict": n, "temperature": 0, "n_probs": 1}
            r = http.post(f"{server.url}/completion", json=body).json()
            return r["timings"]["prompt_n"], [p["logprob"] for p in r["completion_probabilities"]]

        complete(history, 40)  # the slot holds the history and a reply
        from_slot = complete(prompt)
        complete(history, 40)
        complete("unrelated " + question * 3)  # the history goes to host RAM
        restored = complete(prompt)
    print(f"cut from the slot:           computed {from_slot[0]} tokens, logprobs {_fmt(from_slot[1])}")
    print(f"cut from a restored state:   computed {restored[0]} tokens, logprobs {_fmt(restored[1])}")
    same = from_slot == restored
    print("the same" if same else "different: the restored state's window layers miss positions the cut needs")


def _fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.4f}" for x in xs[:6])


if __name__ == "__main__":
    main()
