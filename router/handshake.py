"""A worker's hello, read: whether the router takes it, and what its slots already hold."""

from __future__ import annotations

import numpy as np

from protocol import ErrorCode, Hello, Refuse, token_array

# slot -> (tokens, exact tokens, tenant, tokens it must keep, its checkpoints)
Held = dict[int, tuple[np.ndarray, int, str, int, list[int]]]


def refusal(identity: bytes, msg: Hello, fingerprint: str, weights: str, model: str) -> Refuse | None:
    """Why the router does not take this worker (None: it does): a ZMQ identity other than its id, another model
    (vocabulary and template: the fingerprint), or the same vocabulary with other weights (when both say which)."""
    if identity != msg.worker_id.encode():
        return Refuse(code=ErrorCode.BAD_REQUEST, reason="ZMQ identity must equal worker_id")
    if msg.model_fingerprint != fingerprint:
        reason = f"model fingerprint {msg.model_fingerprint[:16]} differs from the router's {fingerprint[:16]} ({model})"
        return Refuse(code=ErrorCode.MODEL_MISMATCH, reason=reason)
    if weights and msg.weights_fingerprint and msg.weights_fingerprint != weights:
        reason = (
            f"model weights {msg.weights_fingerprint[:16]} differ from the router's {weights[:16]} ({model}):"
            " the same vocabulary with other weights (another quantization or fine-tune) would answer differently"
        )
        return Refuse(code=ErrorCode.MODEL_MISMATCH, reason=reason)
    return None


def held(msg: Hello) -> Held | None:
    """What each slot holds, as the worker reports it (the mirror starts from it); None when it does not say."""
    if msg.held is None:
        return None
    return {h.slot: (token_array(h.tokens), h.n_exact, h.salt, h.min_keep, list(h.cuts)) for h in msg.held}
