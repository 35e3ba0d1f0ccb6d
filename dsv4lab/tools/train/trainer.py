"""Training the small DeepSeek-V4 models with the reference modules themselves, then quantizing them natively.

The model trained here *is* :class:`dsv4lab.core.model.transformer.Transformer` — the same modules and the same
:class:`~dsv4lab.core.model.ops.ReferenceOps` the engine runs — with float master weights:

* :func:`build_trainable` turns every ``Linear`` into the ``"f32"`` format (``dequantized()`` returns the weight
  itself) and every routed-expert bank into an ``"f32"`` :class:`~dsv4lab.core.model.linear.ExpertBank`, and makes
  every other buffer a ``torch.nn.Parameter`` — except the router's ``gate.bias`` (updated by the load-balancing
  rule, no gradient) and the hash layers' ``tid2eid`` (fixed random). Values are initialised per tensor from
  ``(seed, name)``.
* Numerics: ``float32`` with every quantization simulation off and plain fp32 reductions
  (``exact_reductions=False``; the fp64 reductions are for the oracle). A full sequence is one prefill with
  freshly allocated caches; gradients flow through the in-place cache writes (compressed entries, window ring).
* :class:`TrainingOps` (a :class:`ReferenceOps` subclass) adds what training needs and inference must not have:
  the per-bank expert load (for the ``noaux_tc`` bias update) and the lightning indexer's auxiliary loss. The
  indexer's top-k is not differentiable, so, as in DeepSeek's sparse attention, the indexer learns from a KL
  loss towards the main attention's distribution over the compressed entries (head-averaged, detached), with
  its inputs detached so that loss trains only the indexer.
* Losses: next-token cross-entropy + ``mtp_weight`` × the MTP block's cross-entropy on the token after next
  (the MTP block is trained) + ``indexer_weight`` × the indexer KL.

After training, :func:`native_state_dict` quantizes into the native format (routed experts FP4 E2M1 with E8M0
per-32 scales, dense projections FP8 E4M3 with 128×128 E8M0 block scales, the rest BF16/F32 as in the real
checkpoint) and :func:`export_checkpoint` writes it, evaluates it with :func:`dsv4lab.load`, records greedy
oracles and writes ``train_report.json``. ``dsv4lab train-small`` drives the steps (see ``docs/training.md``).
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dsv4lab.core import quant
from dsv4lab.core.checkpoint import TORCH_DTYPE, Checkpoint, expected_tensors, file_hashes, write_state_dict
from dsv4lab.core.config import ModelArgs, get_preset
from dsv4lab.engine.backends import make_ops
from dsv4lab.engine.loader import load
from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.moe import MoE
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.model.transformer import Transformer
from dsv4lab.core.paths import DEFAULT_TOKENIZER
from dsv4lab.core.provenance import write_json
from dsv4lab.core.tokenizer import Tokenizer
from dsv4lab.tools.train import corpus


# ============================================================================================ the model
def _tensor_generator(seed: int, name: str) -> torch.Generator:
    """Per-tensor generator: a tensor's initial value depends on (seed, name) only, not on creation order."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))


def _is_residual_output(name: str) -> bool:
    """Projections that write into the residual streams (scaled down at init, GPT-2 style)."""
    return name.endswith(("attn.wo_b.weight", "shared_experts.w2.weight", "experts.w2"))


def initial_value(name: str, shape: tuple[int, ...], args: ModelArgs, seed: int) -> torch.Tensor:
    """The initial float32 value of tensor ``name`` (a model state-dict name) of ``shape``.

    Linear weights are N(0, 1/fan_in) (residual-stream outputs additionally ÷ √(2·n_layers)); norms are 1;
    the mHC ``pre`` gates start at 1/hc_mult (the streams' mean), ``post`` at 1, ``comb`` near the identity, with
    small data-dependent terms (``scale`` 0.1) that break the symmetry between the streams.
    """
    g = _tensor_generator(seed, name)
    n = args.hc_mult

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    if name.endswith("tid2eid"):  # hash routing: k distinct random experts per token id, fixed
        keys = torch.rand(shape[0], args.n_routed_experts, generator=g)
        return keys.argsort(-1)[:, : shape[1]].contiguous()
    if name.endswith("gate.bias") or name.endswith("attn_sink") or name.endswith("ape"):
        return torch.zeros(shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "embed.weight":
        return normal(1.0)
    if name.endswith("hc_head_base"):
        return torch.full(shape, math.log(1 / (n - 1)))  # sigmoid(base) = 1/n
    if name.endswith("_base"):  # [pre n | post n | comb n·n]
        base = torch.zeros(shape)
        base[:n] = math.log(1 / (n - 1))
        base[2 * n:] = (torch.eye(n) * 4.0).flatten()
        return base
    if name.endswith("_fn"):
        return normal(shape[-1] ** -0.5)
    if name.endswith("_scale"):
        return torch.full(shape, 0.1)
    if name.endswith("experts.w1") or name.endswith("experts.w2") or name.endswith("experts.w3"):
        std = shape[-1] ** -0.5
    elif len(shape) == 2:
        std = shape[1] ** -0.5
    else:
        raise ValueError(f"initial_value: no rule for tensor {name!r} of shape {list(shape)}")
    if _is_residual_output(name):
        std /= math.sqrt(2 * args.n_layers)
    return normal(std)


def _fixed_buffer(module: nn.Module, attr: str) -> bool:
    """Buffers that stay buffers in training: the router bias (load-balancing rule) and ``tid2eid`` (fixed)."""
    return attr in ("bias", "tid2eid") and module.__class__.__name__ == "Gate"


def build_trainable(args: ModelArgs, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """The reference :class:`Transformer` with float32 master weights as Parameters (see the module doc)."""
    model = Transformer(args)
    for m in model.modules():
        if isinstance(m, MoE):
            m.experts = ExpertBank(m.experts.n_experts, args.dim, args.moe_inter_dim, "f32", m.experts.expert_offset)
    for mod_name, module in model.named_modules():
        if isinstance(module, Linear):
            module.fmt = "f32"
            module._buffers["weight"] = torch.empty(module.out_features, module.in_features, device="meta")
            module._buffers["scale"] = None
            module.cache_dequant = False
        for attr, buf in list(module._buffers.items()):
            if buf is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            value = initial_value(full, tuple(buf.shape), args, seed).to(device)
            if _fixed_buffer(module, attr):
                module._buffers[attr] = value
            else:
                del module._buffers[attr]
                module.register_parameter(attr, nn.Parameter(value))
    for name in ("wq_b", "weights_proj"):  # the indexer learns from its own loss only (see TrainingOps)
        for blk in model.blocks():
            if blk.attn.indexer is not None:
                getattr(blk.attn.indexer, name).detach_input = True
    for blk in model.blocks():
        if blk.attn.indexer is not None:
            blk.attn.indexer.compressor.wkv.detach_input = True
            blk.attn.indexer.compressor.wgate.detach_input = True
    return model


def training_numerics() -> Numerics:
    """float32, every quantization simulation off, plain fp32 reductions."""
    return Numerics(dtype=torch.float32, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False,
                    exact_reductions=False)


class TrainingOps(ReferenceOps):
    """The reference ops plus what training needs: expert loads and the lightning indexer's auxiliary loss.

    Every op computes exactly what :class:`ReferenceOps` computes; the overrides only record, or detach the
    input of projections marked ``detach_input`` (the indexer's, so its loss does not reach the main model).
    """

    name = "reference+train"

    def __init__(self, numerics: Numerics):
        super().__init__(numerics)
        self.expert_load: dict[int, torch.Tensor] = {}
        self.indexer_losses: list[torch.Tensor] = []
        self._pending_indexer: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def clear(self) -> None:
        self.expert_load.clear()
        self.indexer_losses.clear()
        self._pending_indexer = None

    def linear(self, x, lin, all_reduce=None):
        return super().linear(x.detach() if getattr(lin, "detach_input", False) else x, lin, all_reduce)

    def linear_f32(self, x, lin):
        return super().linear_f32(x.detach() if getattr(lin, "detach_input", False) else x, lin)

    def routed_experts(self, x, idx, weights, bank, limit, trace=None, all_reduce=None):
        counts = torch.bincount(idx.flatten(), minlength=bank.expert_offset + bank.n_experts).float()
        key = id(bank)
        self.expert_load[key] = self.expert_load.get(key, 0) + counts
        return super().routed_experts(x, idx, weights, bank, limit, trace, all_reduce)

    def indexer_topk(self, scores, positions, ratio, topk):
        self._pending_indexer = (scores, positions, ratio)
        return super().indexer_topk(scores.detach(), positions, ratio, topk)

    def sparse_attention(self, q, kv, idx, sink, scale):
        if self._pending_indexer is not None:  # the CSA layer whose indexer just scored: compare with attention
            scores, positions, ratio = self._pending_indexer
            self._pending_indexer = None
            self.indexer_losses.append(indexer_kl(q.detach(), kv[:, kv.shape[1] - scores.shape[-1]:].detach(),
                                                  scores, positions, ratio, scale))
        return super().sparse_attention(q, kv, idx, sink, scale)


def indexer_kl(q: torch.Tensor, entries: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor,
               ratio: int, scale: float) -> torch.Tensor:
    """KL(target ‖ softmax(indexer scores)) over the visible compressed entries, mean over queries that see any.

    ``q [b,s,h,d]``, ``entries [b,T,d]`` (the layer's compressed KV), ``scores [b,s,T]``; the target is the main
    attention's softmax over the compressed entries alone, averaged over heads.
    """
    T = scores.shape[-1]
    visible = torch.arange(T, device=scores.device)[None, None, :] < ((positions + 1) // ratio)[..., None]
    has_any = visible.any(-1)
    if not bool(has_any.any()):
        return scores.sum() * 0.0
    # rows that see nothing are dropped at the end; unmasking them keeps every softmax finite (no NaN gradients)
    mask = visible | ~has_any[..., None]
    calc = torch.promote_types(scores.dtype, torch.float32)
    logits = torch.einsum("bshd,btd->bsht", q.to(calc), entries.to(calc)) * scale
    target = logits.masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1).mean(2)
    logp = scores.to(calc).masked_fill(~mask, float("-inf")).log_softmax(-1).masked_fill(~mask, 0.0)
    kl = (target * (target.clamp_min(1e-30).log() - logp)).sum(-1)
    return kl[has_any].mean()


def update_router_biases(model: Transformer, ops: TrainingOps, rate: float) -> dict[str, float]:
    """``noaux_tc`` load balancing: ``bias += rate · sign(mean load − load)`` per biased MoE layer.

    Returns the max/mean expert load ratio of every MoE layer (``block{i}.bias`` or ``block{i}.hash``; 1.0 is
    perfectly balanced; hash layers have no bias to move).
    """
    imbalance = {}
    for i, blk in enumerate(model.blocks()):
        gate = blk.ffn.gate
        load = ops.expert_load.get(id(blk.ffn.experts))
        if load is None:
            continue
        if gate.bias is not None:
            with torch.no_grad():
                gate.bias += rate * torch.sign(load.mean() - load)
        kind = "hash" if gate.bias is None else "bias"
        imbalance[f"block{i}.{kind}"] = float(load.max() / load.mean().clamp_min(1e-9))
    return imbalance


def lm_losses(model: Transformer, ops: TrainingOps, window: torch.Tensor, mtp_weight: float,
              indexer_weight: float) -> dict[str, torch.Tensor]:
    """Run ``window [b, n+2]`` and return the losses: ``lm`` (next token), ``mtp`` (token after next),
    ``indexer`` (KL), ``total``. Caches are allocated fresh: one call is one prefill of ``n`` tokens per row."""
    b, n = window.shape[0], window.shape[1] - 2
    device = window.device
    nm = ops.numerics
    model.allocate(b, nm.act, nm.acc, device)
    ops.clear()
    tokens, targets = window[:, :n], window[:, 1:n + 1]
    start = torch.zeros(b, dtype=torch.long, device=device)
    lengths = torch.full((b,), n, dtype=torch.long, device=device)
    slots = torch.arange(b, device=device)
    logits, X = model(tokens, start, lengths, slots, ops, return_hidden=True)
    out = {"lm": F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))}  # logits in acc
    total = out["lm"]
    if mtp_weight > 0 and len(model.mtp):
        mtp = model.mtp[0]
        next_embed = model.embed.weight[targets].to(nm.act)
        y = mtp.forward_mtp(X, next_embed, start, lengths, slots, targets, ops)
        mtp_logits = ops.linear_f32(y, model.head)
        out["mtp"] = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]),
                                     window[:, 2:].reshape(-1))
        total = total + mtp_weight * out["mtp"]
    if ops.indexer_losses:
        out["indexer"] = torch.stack(ops.indexer_losses).mean()
        total = total + indexer_weight * out["indexer"]
    out["total"] = total
    return out


# ============================================================================================ data
def prepare_tokens(out_dir: str | Path, tokenizer: str | Path = DEFAULT_TOKENIZER,
                   packed_corpus: str | Path | None = None) -> Path:
    """Tokenize the corpus (this interpreter's stdlib, or a :func:`dsv4lab.tools.train.corpus.pack_corpus` file) into
    ``tokens.npz`` (``train``/``heldout`` uint16 streams) and ``tokens.json`` (what they were made from).

    Each file becomes ``BOS + ids(text) + EOS``; files are concatenated in the corpus's sorted order.
    """
    tok = Tokenizer(tokenizer)
    if packed_corpus is not None:
        split = corpus.load_packed(packed_corpus)
        manifest = {"digest": hashlib.sha256(json.dumps(
            {k: [[p, hashlib.sha256(t.encode()).hexdigest()] for p, t in v] for k, v in split.items()},
            sort_keys=True).encode()).hexdigest(), "source": str(packed_corpus)}
    else:
        split = corpus.read_corpus()
        manifest = corpus.corpus_manifest()
        manifest = {k: manifest[k] for k in ("root", "n_files", "n_heldout", "digest")}
    streams = {}
    for part, docs in split.items():
        enc = tok._tok.encode_batch([t for _, t in docs], add_special_tokens=False)
        ids = []
        for e in enc:
            ids.append(tok.bos_id)
            ids.extend(e.ids)
            ids.append(tok.eos_id)
        streams[part] = np.asarray(ids, dtype=np.uint16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "tokens.npz", **streams)
    meta = dict(corpus_manifest=manifest, python=sys.version.split()[0],
                tokenizer=Path(tokenizer).name,
                tokenizer_sha256=hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest(),
                n_files={k: len(v) for k, v in split.items()}, n_tokens={k: int(len(v)) for k, v in streams.items()},
                document_format="BOS + tokens + EOS per file, files in sorted path order")
    write_json(out / "tokens.json", meta, indent=2)
    return out


def load_tokens(folder: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    folder = Path(folder)
    if not (folder / "tokens.npz").exists():
        raise FileNotFoundError(f"{folder}: no tokens.npz (run `dsv4lab train-small prepare --out {folder}`)")
    with np.load(folder / "tokens.npz") as z:
        streams = {k: z[k] for k in z.files}
    return streams, json.loads((folder / "tokens.json").read_text())


def heldout_windows(stream: np.ndarray, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping evaluation windows ``[m, seq_len + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``).

    With ``limit``, ``limit`` windows spread evenly over the stream (first and last included), so a subset
    samples every part of the held-out split rather than its first files.
    """
    m = (len(stream) - 1) // seq_len
    rows = np.arange(m)
    if limit is not None and limit < m:
        rows = np.unique(np.round(np.linspace(0, m - 1, limit)).astype(np.int64))
    idx = rows[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


def unigram_ppl(train: np.ndarray, windows: torch.Tensor, vocab: int) -> float:
    """Perplexity of the add-one-smoothed unigram distribution of ``train`` on the windows' targets."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[windows[:, 1:].numpy()].mean()))


# ============================================================================================ training
@dataclass(frozen=True)
class TrainConfig:
    """One training run (the defaults are the recipe of ``data/tiny-py``).

    Attributes:
        preset: architecture preset (``tiny``).
        seed: initialisation and data-order seed.
        seq_len: tokens per training sequence (each row is one prefill from position 0).
        batch_size: sequences per step.
        steps: optimizer steps of the schedule; 0 = choose from ``time_budget_s`` after ``calibration_steps``
            timed steps (recorded as ``schedule_steps``; rerun with ``steps`` set to it to repeat the run).
        stop_at: stop after this many steps although the schedule is longer (0: at its end); with ``steps``
            it repeats a run that the time budget's hard stop ended early.
        time_budget_s: wall-clock budget for the training loop when ``steps`` is 0 (1.1× it is a hard stop).
        calibration_steps: steps timed before the step count is chosen (all within the warm-up).
        lr: peak AdamW learning rate; warm-up ``warmup_steps`` linear, then cosine to ``lr·min_lr_ratio``.
        weight_decay: decoupled weight decay of the matrices (projections, experts, embedding, head).
        grad_clip: global gradient-norm clip.
        mtp_weight: weight of the MTP block's loss (0 leaves it at init).
        indexer_weight: weight of the indexer's KL loss.
        bias_update_rate: ``noaux_tc`` bias step per optimizer step.
        eval_every: steps between held-out evaluations (0: only at the end).
        eval_windows: held-out windows (of the preset's ``max_seq_len``) evaluated during training; all of them
            at the end.
    """

    preset: str = "tiny"
    seed: int = 0
    seq_len: int = 4096
    batch_size: int = 4
    steps: int = 0
    stop_at: int = 0
    time_budget_s: float = 320.0
    calibration_steps: int = 12
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    indexer_weight: float = 1.0
    bias_update_rate: float = 2e-3
    eval_every: int = 200
    eval_windows: int = 16


EVAL_BATCH = 16  # held-out windows per forward during training


def learning_rate(cfg: TrainConfig, step: int, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _param_groups(model: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        matrix = name.endswith(("experts.w1", "experts.w2", "experts.w3")) or (
            name.endswith(".weight") and p.ndim == 2)
        (decay if matrix else no_decay).append(p)
    return [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]


@torch.no_grad()
def evaluate_nll(model: Transformer, ops: ReferenceOps, windows: torch.Tensor, batch_size: int,
                 device: str | torch.device = "cpu", reference_logprobs: list[torch.Tensor] | None = None,
                 keep_logprobs: bool = False, progress: str | None = None) -> dict:
    """Teacher-forced mean NLL (nats/token) and perplexity over ``windows [m, n+1]``.

    With ``reference_logprobs`` (per batch, as returned with ``keep_logprobs``) also the mean KL(reference ‖ model).
    """
    nm = ops.numerics
    total_nll, total_kl, count = 0.0, 0.0, 0
    kept = []
    batches = range(0, len(windows), batch_size)
    if progress:
        from tqdm.auto import tqdm
        batches = tqdm(batches, desc=progress, unit="batch", leave=False, file=sys.stderr)
    for bi, s in enumerate(batches):
        w = windows[s:s + batch_size].to(device)
        b, n = w.shape[0], w.shape[1] - 1
        model.allocate(b, nm.act, nm.acc, device)
        logits = model(w[:, :n], torch.zeros(b, dtype=torch.long, device=device),
                       torch.full((b,), n, dtype=torch.long, device=device), torch.arange(b, device=device), ops)
        logp = logits.float().log_softmax(-1)
        total_nll += float(-logp.gather(-1, w[:, 1:, None]).sum())
        count += b * n
        if reference_logprobs is not None:
            ref = reference_logprobs[bi].to(device)
            total_kl += float((ref.exp() * (ref - logp)).sum())
        if keep_logprobs:
            kept.append(logp.cpu())
    out = dict(nll=total_nll / count, ppl=math.exp(total_nll / count), tokens=count)
    if reference_logprobs is not None:
        out["kl"] = total_kl / count
    if keep_logprobs:
        out["logprobs"] = kept
    return out


def _device_info(device: torch.device) -> dict:
    info = dict(device=str(device), torch=torch.__version__, python=sys.version.split()[0])
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def train(cfg: TrainConfig, streams: dict[str, np.ndarray], device: str | torch.device = "cpu",
          log: Callable[[str], None] = print) -> tuple[Transformer, dict]:
    """Train a model of ``cfg.preset`` on the token ``streams``; returns the model and the training log."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    args = get_preset(cfg.preset)
    if cfg.seq_len > args.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_position_embeddings "
                         f"{args.max_position_embeddings}")
    eval_len = args.max_seq_len  # held-out windows as `export` evaluates them: one prefill of max_seq_len tokens
    # max_seq_len only sizes caches and RoPE tables (it is not part of the checkpoint): train on longer rows if
    # asked, which amortises the per-row work of the compressors over more tokens
    args = args.replace(max_seq_len=max(args.max_seq_len, cfg.seq_len))
    model = build_trainable(args, cfg.seed, device)
    ops = TrainingOps(training_numerics())
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=1e-8)
    train_stream = torch.from_numpy(streams["train"].astype(np.int64))
    eval_windows = heldout_windows(streams["heldout"], eval_len)
    if len(eval_windows) == 0:
        raise ValueError(f"the held-out stream has {len(streams['heldout'])} tokens: fewer than one evaluation "
                         f"window of {eval_len + 1}")
    rng = np.random.default_rng(cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {args.summary()}; {n_params:,} trainable parameters; {len(train_stream):,} training tokens; "
        f"{cfg.batch_size}×{cfg.seq_len} tokens per step on {device}")
    history: list[dict] = []
    evals: list[dict] = []
    total = cfg.steps
    step_times: list[float] = []
    t_start = time.perf_counter()
    step = 0
    stopped_early = False
    skipped = 0
    while True:
        if (total and step >= total) or (cfg.stop_at and step >= cfg.stop_at):
            break
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        starts = rng.integers(0, len(train_stream) - cfg.seq_len - 2, size=cfg.batch_size)
        window = torch.stack([train_stream[s:s + cfg.seq_len + 2] for s in starts]).to(device)
        lr = learning_rate(cfg, step, total or 10 ** 9)
        for group in opt.param_groups:
            group["lr"] = lr
        losses = lm_losses(model, ops, window, cfg.mtp_weight, cfg.indexer_weight)
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        if math.isfinite(gnorm):
            opt.step()
            imbalance = update_router_biases(model, ops, cfg.bias_update_rate)
        else:  # a non-finite gradient must not reach the weights; the step is counted and skipped
            skipped += 1
            imbalance = {}
            log(f"step {step}: non-finite gradient norm, update skipped ({skipped} so far)")
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step_times.append(dt)
        row = dict(step=step, lr=lr, grad_norm=gnorm, seconds=dt,
                   **{k: float(v.detach()) for k, v in losses.items()},
                   max_load_biased=max((v for k, v in imbalance.items() if k.endswith("bias")), default=None),
                   max_load_hashed=max((v for k, v in imbalance.items() if k.endswith("hash")), default=None))
        history.append(row)
        step += 1
        if not total and step == cfg.calibration_steps:
            per_step = float(np.median(step_times[2:]))
            elapsed = time.perf_counter() - t_start
            total = max(step + 1, int(step + (cfg.time_budget_s - elapsed) / per_step))
            log(f"calibration: {per_step * 1e3:.0f} ms/step -> {total} steps in {cfg.time_budget_s:.0f} s")
        if step % 10 == 0 or step == 1:
            log(f"step {step}/{total or '?'} loss {row['lm']:.3f} mtp {row.get('mtp', float('nan')):.3f} "
                f"idx {row.get('indexer', float('nan')):.3f} lr {lr:.2e} |g| {gnorm:.2f} "
                f"load max/mean {row['max_load_biased'] or float('nan'):.2f} "
                f"(hash {row['max_load_hashed'] or float('nan'):.2f}) "
                f"{dt * 1e3:.0f} ms")
        if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
            ev = evaluate_nll(model, ReferenceOps(training_numerics()), eval_windows[:cfg.eval_windows],
                              EVAL_BATCH, device)
            evals.append(dict(step=step, heldout_nll=ev["nll"], heldout_ppl=ev["ppl"], tokens=ev["tokens"]))
            log(f"  held-out ({ev['tokens']:,} tokens): nll {ev['nll']:.3f}, ppl {ev['ppl']:.2f}")
        if time.perf_counter() - t_start > 1.1 * cfg.time_budget_s and (not cfg.steps):
            log(f"time budget exceeded at step {step} of {total}: stopping")
            stopped_early = True
            break
    train_seconds = time.perf_counter() - t_start
    t_eval = time.perf_counter()
    ev = evaluate_nll(model, ReferenceOps(training_numerics()), eval_windows, EVAL_BATCH, device)
    evals.append(dict(step=step, heldout_nll=ev["nll"], heldout_ppl=ev["ppl"], tokens=ev["tokens"], final=True))
    log(f"final held-out ({ev['tokens']:,} tokens, float32): nll {ev['nll']:.4f}, ppl {ev['ppl']:.3f} "
        f"({time.perf_counter() - t_eval:.1f} s)")
    report = dict(config=asdict(cfg), steps=step, schedule_steps=total, skipped_steps=skipped,
                  stopped_early=stopped_early,
                  train_seconds=train_seconds,
                  median_step_seconds=float(np.median(step_times)), tokens_seen=step * cfg.batch_size * cfg.seq_len,
                  trainable_parameters=n_params, hardware=_device_info(device), history=history, evals=evals,
                  heldout_ppl_f32=ev["ppl"], heldout_tokens=ev["tokens"])
    return model, report


# ============================================================================================ weights I/O
def save_weights(model: Transformer, out_dir: str | Path, max_shard_bytes: int = 12 << 20) -> list[Path]:
    """Save the trained state (parameters and router buffers) as safetensors shards of ``max_shard_bytes``.

    Tensors the native checkpoint stores as BF16 (embedding, head, norms, router and compressor weights) are
    saved in bf16 — they are only ever used rounded to bf16 — and everything else in float32: the routed
    experts and dense projections (the inputs of FP4/FP8 quantization and of the ablation), and the F32 tensors.
    """
    bf16_in_file = {s.name for s in expected_tensors(model.args) if s.dtype == "BF16"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.bfloat16) if k in bf16_in_file else v.detach()).cpu().contiguous()
             for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    paths = []
    for i, sh in enumerate(shards):
        p = out / f"weights-{i + 1:02d}-of-{len(shards):02d}.safetensors"
        save_file(sh, str(p), metadata={"format": "pt"})
        paths.append(p)
    return paths


def load_weights_f32(folder: str | Path) -> dict[str, torch.Tensor]:
    """The state written by :func:`save_weights`, every float tensor as float32."""
    files = sorted(Path(folder).glob("weights-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no weights-*.safetensors (the output of `dsv4lab train-small train`)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(f)).items()})
    return state


def read_train_log(weights_dir: str | Path) -> dict:
    """The ``train_log.json`` that `dsv4lab train-small train` wrote next to the weights."""
    path = Path(weights_dir) / "train_log.json"
    if not path.exists():
        raise FileNotFoundError(f"{weights_dir}: no train_log.json (the output folder of `dsv4lab train-small train`)")
    return json.loads(path.read_text())


def trainable_from_state(args: ModelArgs, state: dict[str, torch.Tensor]) -> Transformer:
    model = build_trainable(args, 0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise KeyError(f"trained state does not match the {args.summary()} model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return model


# ============================================================================================ quantization
def _expert_source(name: str) -> tuple[str, int, str] | None:
    """``layers.3.ffn.experts.7.w2.weight`` → (``layers.3.ffn.experts.w2``, 7, ``weight``)."""
    parts = name.split(".")
    if len(parts) >= 6 and parts[-4] == "experts" and parts[-3].isdigit():
        return ".".join(parts[:-3] + [parts[-2]]), int(parts[-3]), parts[-1]
    return None


def native_state_dict(args: ModelArgs, state: dict[str, torch.Tensor],
                      expert_quantizer: Callable | None = None,
                      dense_quantizer: Callable | None = None) -> dict[str, torch.Tensor]:
    """Quantize a float32 trained state into the native tensors of ``args`` (names, dtypes and shapes of
    :func:`dsv4lab.core.checkpoint.expected_tensors`): FP4 experts via ``quant.fp4_quantize`` (E2M1, E8M0 per 32),
    FP8 dense projections via ``quant.fp8_block_quantize`` (E4M3, 128×128 E8M0), BF16 and F32 elsewhere."""
    expert_quantizer = expert_quantizer or (quant.fp4_quantize if args.expert_dtype == "fp4"
                                            else quant.fp8_block_quantize)
    dense_quantizer = dense_quantizer or quant.fp8_block_quantize
    out: dict[str, torch.Tensor] = {}
    for spec in expected_tensors(args):
        if spec.name in out:
            continue
        src = _expert_source(spec.name)
        if src is not None:
            bank, e, kind = src
            if kind == "weight":
                w, s = expert_quantizer(state[bank][e].float())
                out[spec.name] = w
                out[spec.name[: -len("weight")] + "scale"] = s
            continue
        if spec.name.endswith(".scale"):  # produced with its weight
            continue
        t = state[spec.name]
        if spec.dtype in ("F8_E4M3", "I8"):
            w, s = dense_quantizer(t.float())
            out[spec.name] = w
            out[spec.name[: -len("weight")] + "scale"] = s
        else:
            out[spec.name] = t.to(TORCH_DTYPE[spec.dtype]).contiguous()
    return out


def bf16_rounded_state(args: ModelArgs, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained state as an unquantized bf16 checkpoint would hold it: the tensors the native file stores in
    F32 (mHC, ``attn_sink``, ``ape``, router bias) kept, every other float tensor rounded to bf16 (returned as
    float32 so the trainable model can hold it)."""
    f32_in_file = {s.name for s in expected_tensors(args) if s.dtype == "F32"}
    return {k: (v if (k in f32_in_file or not v.is_floating_point()) else v.to(torch.bfloat16).float())
            for k, v in state.items()}


# ============================================================================================ export
ORACLE_PROMPTS = (
    "import os\nimport sys\n",
    "def __init__(self",
    "    if not isinstance(",
    "class Error(Exception):\n",
    "        return self.",
)


def record_oracles(runner, prompts: Iterable[str] = ORACLE_PROMPTS, max_new_tokens: int = 40) -> list[dict]:
    """Greedy completions (``BOS + prompt``) with the runner's settings: prompt, ids, completion, hash."""
    tok = runner.tokenizer
    rows = []
    for prompt in prompts:
        ids = tok.encode(prompt, add_bos=True)
        out = runner.generate(ids, max_new_tokens, temperature=0.0, stop_at_eos=True)
        rows.append(dict(prompt=prompt, prompt_ids=ids, output_ids=out, completion=tok.decode(out),
                         hash=trajectory_hash(out)))
    return rows


def export_checkpoint(weights_dir: str | Path, out: str | Path, tokens_dir: str | Path,
                      tokenizer: str | Path = DEFAULT_TOKENIZER, eval_windows: int | None = None,
                      max_new_tokens: int = 40, overwrite: bool = False, log: Callable[[str], None] = print) -> dict:
    """Quantize the trained weights into a native checkpoint at ``out``, validate it, evaluate held-out
    perplexity (bf16 unquantized, quantized as loaded by :func:`dsv4lab.load`), record oracles and write
    ``train_report.json`` and ``oracles.json`` into ``out``. Returns the report."""
    weights_dir, out = Path(weights_dir), Path(out)
    train_log = read_train_log(weights_dir)
    cfg = train_log["config"]
    args = get_preset(cfg["preset"])
    state = load_weights_f32(weights_dir)
    streams, token_meta = load_tokens(tokens_dir)
    native = native_state_dict(args, state)
    write_state_dict(out, args, native, n_shards=2, extra_files={"tokenizer.json": tokenizer}, overwrite=overwrite)
    rep = Checkpoint(out).validate(scan_values=True)
    rep.raise_if_failed()
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"wrote {out}: {rep.inventory.tensors} tensors, {size / 1e6:.2f} MB; validation OK")

    seq_len = args.max_seq_len
    windows = heldout_windows(streams["heldout"], seq_len, eval_windows)
    uni = unigram_ppl(streams["train"], windows, args.vocab_size)
    bf16_numerics = Numerics(torch.bfloat16, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False,
                             exact_reductions=False)
    t0 = time.perf_counter()
    bf16_model = trainable_from_state(args, bf16_rounded_state(args, state))
    ev_bf16 = evaluate_nll(bf16_model, ReferenceOps(bf16_numerics), windows, 4, progress="held-out, bf16 weights")
    log(f"held-out ppl, bf16 weights (sims off): {ev_bf16['ppl']:.3f} ({time.perf_counter() - t0:.0f} s)")
    del bf16_model

    runner = load(out, dtype=torch.bfloat16, max_batch=4, max_seq_len=seq_len)
    t0 = time.perf_counter()
    ev_q = evaluate_nll(runner.model, runner.ops, windows, 4, progress="held-out, native checkpoint")
    log(f"held-out ppl, native checkpoint via dsv4lab.load(dtype=bf16): {ev_q['ppl']:.3f} "
        f"({time.perf_counter() - t0:.0f} s)")
    ev_q_nosim = evaluate_nll(runner.model, make_ops("reference", bf16_numerics), windows, 4,
                              progress="held-out, native weights, sims off")
    log(f"held-out ppl, native weights with the simulations off: {ev_q_nosim['ppl']:.3f}")

    runner.reset()
    oracles = record_oracles(runner, max_new_tokens=max_new_tokens)
    exact = load(out, dtype=torch.float32, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False, max_batch=1)
    oracles_f32 = record_oracles(exact, max_new_tokens=max_new_tokens)
    for row in oracles:
        log(f"  {row['prompt']!r} -> {row['completion']!r}")

    oracle_doc = dict(
        checkpoint=out.name, max_new_tokens=max_new_tokens, add_bos=True, decoding="greedy (temperature 0)",
        settings="dsv4lab.load(checkpoint, dtype=torch.bfloat16) — reference backend, every simulation on",
        oracles=oracles,
        float32_exact=dict(settings="dsv4lab.load(checkpoint, dtype=torch.float32, act_quant=False, "
                                    "kv_fp8_sim=False, indexer_fp4_sim=False)", oracles=oracles_f32))
    write_json(out / "oracles.json", oracle_doc, indent=2)
    report = dict(
        checkpoint=out.name, architecture=f"preset {cfg['preset']!r}: {args.summary()}",
        heldout_ppl_bf16=ev_bf16["ppl"], heldout_ppl_quantized=ev_q["ppl"],
        heldout_ppl_quantized_sims_off=ev_q_nosim["ppl"], unigram_ppl=uni,
        quantized_over_bf16_ppl=ev_q["ppl"] / ev_bf16["ppl"],
        acceptance=dict(rule="heldout_ppl_quantized < unigram_ppl / 2", passed=ev_q["ppl"] < uni / 2),
        heldout_ppl_f32_at_training=train_log["heldout_ppl_f32"],
        evaluation=dict(
            heldout_tokens=ev_q["tokens"], windows=len(windows), window_tokens=seq_len,
            heldout_ppl_bf16="trained weights rounded to bf16 (F32 tensors of the file kept), reference ops in "
                             "bf16 with every quantization simulation off (fp32 reductions)",
            heldout_ppl_quantized="the written native checkpoint loaded with dsv4lab.load(dtype=torch.bfloat16): "
                                  "reference backend, activation FP8, KV FP8 and indexer FP4 simulations on",
            heldout_ppl_quantized_sims_off="the native checkpoint's weights, simulations off (weight "
                                           "quantization alone)",
            unigram_ppl="add-one smoothed unigram of the training split, same held-out targets",
            windows_note=f"{len(windows)} non-overlapping windows of {seq_len} tokens spread evenly over the "
                         f"held-out token stream ({len(streams['heldout']):,} tokens), each a prefill from "
                         "position 0; heldout_ppl_f32_at_training is the float32 model on all windows (GPU)"),
        training=dict(steps=train_log["steps"], schedule_steps=train_log.get("schedule_steps"),
                      reproduce=f"dsv4lab train-small train --tokens TOKENS --out DIR --device cuda --steps "
                                f"{train_log.get('schedule_steps')} --stop-at {train_log['steps']}",
                      train_seconds=train_log["train_seconds"],
                      median_step_seconds=train_log["median_step_seconds"], tokens_seen=train_log["tokens_seen"],
                      trainable_parameters=train_log["trainable_parameters"], hardware=train_log["hardware"],
                      seed=cfg["seed"], config=cfg, stopped_early=train_log["stopped_early"],
                      final_train_loss=train_log["history"][-1]["lm"], evals=train_log["evals"],
                      recipe="dsv4lab train-small train (dsv4lab/tools/train/trainer.py): AdamW, warm-up + cosine, "
                             "LM + 0.3·MTP + indexer-KL losses, noaux_tc bias balancing, tid2eid fixed random"),
        corpus=dict(token_meta, heldout_split="sha256(relative path)[0] < 13 (dsv4lab/tools/train/corpus.py)"),
        quantization=dict(routed_experts="FP4 E2M1, E8M0 scale per 32 along K (quant.fp4_quantize)",
                          dense="FP8 E4M3, 128x128 E8M0 block scales (quant.fp8_block_quantize)",
                          other="BF16 (embedding, head, norms, router, compressor, indexer weights_proj); F32 "
                                "(mHC, attn_sink, ape, router bias); I64 tid2eid"),
        files=file_hashes(out) | {"bytes_total": size},
        oracles=[dict(prompt=r["prompt"], completion=r["completion"], hash=r["hash"]) for r in oracles],
    )
    report["files"].pop("train_report.json", None)
    write_json(out / "train_report.json", report, indent=2)
    log(f"unigram ppl {uni:.2f}; quantized {ev_q['ppl']:.3f} < {uni / 2:.2f}: {report['acceptance']['passed']}")
    return report


__all__ = ["TrainConfig", "TrainingOps", "build_trainable", "training_numerics", "train", "lm_losses",
           "prepare_tokens", "load_tokens", "heldout_windows", "unigram_ppl", "evaluate_nll", "save_weights",
           "load_weights_f32", "read_train_log", "trainable_from_state", "native_state_dict", "bf16_rounded_state",
           "export_checkpoint", "record_oracles", "initial_value", "indexer_kl", "update_router_biases"]
