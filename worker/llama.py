"""Thin ctypes layer over llama.cpp: the model, the context (one stream per slot), the batch, the memory calls.

Only the compute thread may call into a `Llama` after construction (llama.cpp contexts are not thread safe).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llama_cpp

from common import logs
from common.model import ModelError
from common.vocab import Vocab, init_backend
from worker.buffers import BufferPool
from worker.context_size import (
    CtxChoice,
    SwaChoice,
    auto_ctx_per_slot,
    choose_swa_full,
    default_budget_bytes,
    swa_layers,
)

if TYPE_CHECKING:
    from worker.buffers import StateData


KV_GGML_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
KV_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # ggml blocks of 32 values: scale + quants

# A prompt chunk of one sequence alone in its llama_decode, padded (rows after its tokens, removed after) to a multiple
# of ALONE_ROWS_STEP rows and at least ALONE_ROWS_MIN, computes each token's KV to the same bits wherever the chunk
# starts and however long it is. Measured on CPU with llama.cpp's default kernels (bench/exact_shapes.py --alone):
# repacked weights compute rows in fours and the rest one by one, flash attention tiles from 64 rows of a sequence;
# 60 rows, or a multiple of 2, is not enough. (16: AMX computes rows in tiles of 16.) Seeded jobs rest on it.
ALONE_ROWS_MIN = 64
ALONE_ROWS_STEP = 16


def alone_rows(n: int) -> int:
    """Rows of the padded chunk that computes `n` prompt tokens of one sequence as every such chunk does."""
    return max(ALONE_ROWS_MIN, -(-n // ALONE_ROWS_STEP) * ALONE_ROWS_STEP)


_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

log = logs.get(__name__)


@dataclass(frozen=True)
class ModelInfo:
    n_layer: int
    n_swa: int
    recurrent: bool  # memory cannot be trimmed partially (recurrent or hybrid)
    kv_bytes: int
    swa_full: bool = True  # sliding-window layers keep every position (else only their window: worker/checkpoints.py)


class Batch:
    """One reusable llama_batch with direct views on its arrays (no per-step allocation)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        addr = ctypes.addressof
        # ctypes arrays over the batch's own memory (Any: they take slices of plain ints, which typeshed does not say)
        self.token: Any = (ctypes.c_int32 * capacity).from_address(addr(self.raw.token.contents))
        self.pos: Any = (ctypes.c_int32 * capacity).from_address(addr(self.raw.pos.contents))
        self.logits: Any = (ctypes.c_int8 * capacity).from_address(addr(self.raw.logits.contents))
        n_seq = (ctypes.c_int32 * capacity).from_address(addr(self.raw.n_seq_id.contents))
        n_seq[:] = [1] * capacity
        self.seq = [self.raw.seq_id[i] for i in range(capacity)]  # row -> int32* (one seq id per row)
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one row; returns its index."""
        i = self.n
        self.token[i] = token
        self.pos[i] = pos
        self.seq[i][0] = seq
        self.logits[i] = logits
        self.n = i + 1
        return i

    def add_run(self, tokens: list[int], pos0: int, seq: int, last_logits: bool) -> int:
        """Append consecutive tokens of one sequence; only the last row may ask for logits. Returns its index."""
        i, n = self.n, len(tokens)
        j = i + n
        self.token[i:j] = tokens
        self.pos[i:j] = range(pos0, pos0 + n)
        self.logits[i:j] = bytes(n)
        seq_rows = self.seq
        for r in range(i, j):
            seq_rows[r][0] = seq
        self.logits[j - 1] = last_logits
        self.n = j
        return j - 1

    def free(self) -> None:
        if self.raw is not None:
            llama_cpp.llama_batch_free(self.raw)
            self.raw = None


def _model_params(gpu: int | None, n_gpu_layers: int | None, deterministic: bool) -> Any:
    mp = llama_cpp.llama_model_default_params()
    if gpu is None:
        mp.n_gpu_layers = 0
    else:
        if not llama_cpp.llama_supports_gpu_offload():
            raise ModelError(f"--gpu {gpu} asked for, but this llama.cpp build has no GPU support")
        mp.n_gpu_layers = -1 if n_gpu_layers is None else n_gpu_layers  # -1: all layers
        mp.split_mode = 0  # LLAMA_SPLIT_MODE_NONE: whatever is offloaded goes to main_gpu alone
        mp.main_gpu = gpu
    if deterministic:
        mp.use_extra_bufts = False  # repacked CPU weights change results with the batch shape
    return mp


def _context_params(
    slots: int,
    ctx_per_slot: int,
    rows: int,
    threads: int,
    kv_types: tuple[str, str],
    flash_attn: str,
    deterministic: bool,
    swa_full: bool = True,
) -> Any:
    cp = llama_cpp.llama_context_default_params()
    cp.n_seq_max = slots
    cp.n_ctx = slots * ctx_per_slot
    cp.n_batch = rows
    cp.n_ubatch = rows
    cp.kv_unified = False  # one stream per slot: a slot can never run out of cells because of another
    cp.swa_full = swa_full  # sliding-window layers keep every position, so partial trims stay valid (off: checkpoints)
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.no_perf = True
    cp.type_k, cp.type_v = (KV_GGML_TYPES[t] for t in kv_types)
    if deterministic:  # flash attention's result depends on how much of the KV was computed in earlier ubatches
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    elif flash_attn == "on" or (flash_attn == "auto" and kv_types[1] != "f16"):  # quantized values need it
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif flash_attn == "off":
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return cp


class Llama:
    """The model and one context with `slots` independent streams of `ctx_per_slot` cells each."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        slots: int,
        ctx_per_slot: int,
        n_batch: int,
        threads: int,
        gpu: int | None = None,
        deterministic: bool = False,
        kv_types: tuple[str, str] = ("f16", "f16"),
        flash_attn: str = "auto",
        kv_budget_mb: int = 0,
        n_gpu_layers: int | None = None,
        swa_full: str = "on",
        rollback: int = 0,
    ) -> None:
        """`kv_types`: the KV cache's key and value types (f16, q8_0, q4_0); `flash_attn`: auto, on or off
        (WorkerConfig has checked the combinations; deterministic mode turns it off). `ctx_per_slot` 0: the trained
        length capped by `kv_budget_mb` (0: worker.context_size's default). `n_gpu_layers`: None = all (with `gpu`).
        `rollback`: positions a recurrent state can be taken back by (`seq_rm`) right after a decode, where llama.cpp
        can for the architecture (`n_rs_seq`: it keeps that many more copies of the state); 0: none."""
        init_backend()
        self.path = Path(path)
        self.buffers = BufferPool()  # what saved states and checkpoints are copied into (worker/buffers.py)
        mp = _model_params(gpu, n_gpu_layers, deterministic)
        self.model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise ModelError(f"llama.cpp could not load the model {self.path}")
        self.vocab = Vocab.from_model(self.model, self.path)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)
        # decode rows of every slot plus a full prefill chunk, or a seeded job's padded chunk
        self.rows = max(n_batch + slots, alone_rows(n_batch))
        per_token = self._kv_bytes_per_token(kv_types)
        budget = kv_budget_mb * 2**20 if kv_budget_mb else default_budget_bytes(gpu)
        choice, swa = self._choose_ctx(ctx_per_slot, slots, per_token, budget, swa_full)
        ctx_per_slot, full = choice.ctx, swa.full
        cp = _context_params(slots, ctx_per_slot, self.rows, threads, kv_types, flash_attn, deterministic, full)
        recurrent = llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model)
        cp.n_rs_seq = rollback if recurrent else 0
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ModelError(f"llama.cpp could not create a context of {slots} x {ctx_per_slot} tokens for {self.path}")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.rollback = int(llama_cpp.llama_n_rs_seq(self.ctx))  # (llama.cpp gives 0 where the architecture cannot)
        self.slots = slots
        self.ctx_per_slot = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.batch = Batch(self.rows)
        self._decoder: threading.Thread | None = None  # the thread that decodes (`decode`)
        kv_bytes = self._kv_bytes(slots, self.ctx_per_slot, per_token, full)  # (the cells llama.cpp made: padded to 256)
        self.info = self._info(kv_bytes, full)
        self.device = "cpu" if gpu is None else f"cuda:{gpu}"
        log.info(
            "slot_context",
            ctx_per_slot=self.ctx_per_slot,
            reason=choice.reason,
            n_ctx_train=self.n_ctx_train,
            kv_mib=round(self.info.kv_bytes / 2**20, 1),
            **({"kv_budget_mib": choice.budget_bytes >> 20} if choice.budget_bytes else {}),
        )
        if self.info.n_swa > 0:
            log.info("window_cache", full=full, window=self.info.n_swa, reason=swa.reason)

    def _swa_share(self) -> float | None:
        """The share of the per-token KV bytes in sliding-window layers (None: unknown; 0: none)."""
        if llama_cpp.llama_model_n_swa(self.model) <= 0:
            return 0.0
        n_layer = llama_cpp.llama_model_n_layer(self.model)
        arch = self.vocab.meta("general.architecture") or ""
        n = swa_layers(arch, n_layer, self.vocab.arch_meta_int("attention.sliding_window_pattern"))
        return None if n is None or n_layer <= 0 else n / n_layer

    def _kv_bytes(self, slots: int, ctx: int, per_token: float, full: bool) -> int:
        """The KV cache of `slots` slots of `ctx` tokens: window layers of their window alone when not `full` (plus
        the rows of a batch, as llama.cpp sizes them)."""
        share = 0.0 if full else self._swa_share() or 0.0
        window = min(ctx, -(-(llama_cpp.llama_model_n_swa(self.model) + self.rows) // 256) * 256)  # (padded to 256)
        return int(slots * per_token * (ctx * (1 - share) + window * share))

    def _choose_ctx(self, asked: int, slots: int, per_token: float, budget: int, swa_full: str) -> tuple[CtxChoice, SwaChoice]:
        """The slot length to create, and whether window layers keep every position: `asked`, or with 0 the trained
        length capped by the budget (read after the weights are loaded: a GPU's free memory is what they left), with
        window layers of their window alone when the full length fits only so (`choose_swa_full`)."""
        n_swa, share = llama_cpp.llama_model_n_swa(self.model), self._swa_share()
        if asked:
            if asked > self.n_ctx_train > 0:  # llama.cpp serves it, but the model never saw positions that far
                log.warning("ctx_beyond_training", ctx_per_slot=asked, n_ctx_train=self.n_ctx_train)
            return CtxChoice(asked, "--ctx-per-slot"), choose_swa_full(swa_full, n_swa, share, asked, slots, per_token, budget)
        choice = auto_ctx_per_slot(self.n_ctx_train, slots, per_token, budget)  # every layer at full length
        swa = choose_swa_full(swa_full, n_swa, share, max(choice.ctx, self.n_ctx_train), slots, per_token, budget)
        if not swa.full and share:  # the length the budget allows when window layers hold their window alone
            window = slots * per_token * share * -(-(n_swa + self.rows) // 256) * 256
            choice = auto_ctx_per_slot(self.n_ctx_train, slots, per_token * (1 - share), max(0, int(budget - window)))
            choice = dataclasses.replace(choice, budget_bytes=budget)  # (the budget given, window included)
        return choice, swa

    def _kv_bytes_per_token(self, kv_types: tuple[str, str]) -> float:
        """KV bytes one token takes in one slot, every layer. Sliding-window layers count in full: `swa_full` keeps
        every position in them (see below), so they take what a global layer takes. 0 for a recurrent model."""
        m = self.model
        if llama_cpp.llama_model_is_recurrent(m):
            return 0.0
        n_head = max(llama_cpp.llama_model_n_head(m), 1)
        head = llama_cpp.llama_model_n_embd(m) // n_head
        k = self.vocab.arch_meta_int("attention.key_length") or head
        v = self.vocab.arch_meta_int("attention.value_length") or head
        k_bytes, v_bytes = (KV_BYTES_PER_VALUE[t] for t in kv_types)
        return llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m) * (k * k_bytes + v * v_bytes)

    def _info(self, kv_bytes: int, swa_full: bool) -> ModelInfo:
        m = self.model
        recurrent = bool(llama_cpp.llama_model_is_recurrent(m) or llama_cpp.llama_model_is_hybrid(m))
        return ModelInfo(
            n_layer=llama_cpp.llama_model_n_layer(m),
            n_swa=llama_cpp.llama_model_n_swa(m),
            recurrent=recurrent,
            kv_bytes=kv_bytes,
            swa_full=swa_full,
        )

    # ---- calls the engine makes (compute thread only) ----

    def decode(self) -> int:
        """llama_decode of the batch. Only ever from one live thread: llama.cpp's CPU threads are an OpenMP team
        per calling thread, and once a process holds more OpenMP threads than cores, libgomp stops spinning at
        barriers and sleeps instead (measured on 2 cores: decodes of a few rows 2.3x slower, the served
        throughput workload at 0.63x llama-server, when the worker's first decode ran on its main thread)."""
        me = threading.current_thread()
        if self._decoder is not me:
            if self._decoder is not None and self._decoder.is_alive():
                raise RuntimeError(
                    f"llama_decode from thread {me.name!r} while thread {self._decoder.name!r} decodes on this context"
                    " (one thread decodes: worker/llama.py `decode`)"
                )
            self._decoder = me
        self.batch.raw.n_tokens = self.batch.n
        return llama_cpp.llama_decode(self.ctx, self.batch.raw)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_clear(self, seq: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1):
            raise RuntimeError(f"llama.cpp refused to remove whole sequence {seq}")  # documented never to fail

    def seq_len(self, seq: int) -> int:
        """Positions the KV holds for `seq` (pos_max + 1; 0 when empty)."""
        return llama_cpp.llama_memory_seq_pos_max(self.mem, seq) + 1

    def seq_pos_min(self, seq: int) -> int:
        """Lowest position `seq` holds in every layer (-1 when empty). Above 0 only for a state restored from
        `state_get` data: its sliding-window layers come back with just the last window of positions."""
        return llama_cpp.llama_memory_seq_pos_min(self.mem, seq)

    def seq_cp(self, src: int, dst: int) -> None:
        """Make `dst` hold exactly what `src` holds, every layer in full. Slots live in separate streams, so
        llama.cpp copies src's whole stream buffer, at the start of the next `decode` (the cell metadata now)."""
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def min_keep(self, pos_min: int, n: int) -> int:
        """The shortest prefix a sequence of `n` tokens whose memory starts at `pos_min` (`seq_pos_min`,
        `state_pos_min`) can be cut to. A recurrent or hybrid memory cannot be cut at all: `n` (llama.cpp reports its
        recurrent state's position as its pos_min, the last one). Sliding-window layers: the token at position `keep`
        attends to the window after `keep - n_swa`, which must all be there."""
        if self.info.recurrent:
            return n
        return 0 if pos_min <= 0 else min(n, pos_min + self.info.n_swa - 1)

    def holds(self, seq: int, n: int) -> bool:
        """The slot invariant: `seq` holds exactly positions 0..n-1, and as much of them as its memory keeps (a
        recurrent state is at position n-1; sliding-window layers hold at least the window before position n)."""
        held, floor = self.seq_len(seq), self.seq_pos_min(seq)
        if held != n:
            return False
        if self.info.recurrent:  # (hybrid: llama.cpp reports the later of its attention's and its state's pos_min)
            return floor == held - 1
        return floor <= max(0, held - self.info.n_swa + 1)

    def state_pos_min(self, seq: int, n: int) -> int:
        """`seq_pos_min` a sequence of `n` tokens will have once `state_get(seq)` is restored: llama.cpp writes only
        the last window of a sliding-window layer (measured: 1,000 tokens come back from position 488 with
        Gemma 3's window of 512)."""
        floor = max(self.seq_pos_min(seq), 0)
        return max(floor, n - self.info.n_swa) if self.info.n_swa > 0 else floor

    def state_size(self, seq: int) -> int:
        """Bytes `state_get(seq)` would allocate (asked before allocating, so a budget can say no first)."""
        return int(llama_cpp.llama_state_seq_get_size(self.ctx, seq))

    def state_get(self, seq: int) -> StateData:
        """A copy of what `seq` holds (its KV cells and their positions), kept in one ctypes buffer (no extra copy) of
        `buffers` (worker/buffers.py)."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq)
        buf = self.buffers.take(size)
        n = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, seq)
        if n != size:
            raise RuntimeError(f"llama.cpp wrote {n} bytes of state for sequence {seq}, announced {size}")
        return buf

    def state_set(self, seq: int, data: StateData) -> bool:
        """Replace what `seq` holds by a saved state (of this or another sequence). False when llama.cpp refuses."""
        return llama_cpp.llama_state_seq_set_data(self.ctx, data, len(data), seq) != 0

    def partial_size(self, seq: int) -> int:
        """Bytes `partial_get(seq)` would allocate."""
        return int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, _PARTIAL))

    def partial_get(self, seq: int) -> StateData:
        """A copy of the part of what `seq` holds that cannot be cut back (worker/checkpoints.py): a recurrent state,
        or the sliding-window layers' window; not the full-attention KV."""
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, _PARTIAL)
        buf = self.buffers.take(size)
        n = llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, _PARTIAL)
        if n != size:
            raise RuntimeError(f"llama.cpp wrote {n} bytes of partial state for sequence {seq}, announced {size}")
        return buf

    def partial_set(self, seq: int, data: StateData) -> bool:
        """Put back a `partial_get` copy into `seq` (its full-attention KV untouched). False when llama.cpp refuses."""
        return llama_cpp.llama_state_seq_set_data_ext(self.ctx, data, len(data), seq, _PARTIAL) != 0

    def close(self) -> None:
        self.batch.free()
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.vocab.close()
            llama_cpp.llama_model_free(self.model)
            self.model = None
