# %% [markdown]
# # 00 · Quickstart: load a checkpoint, generate, inspect it
#
# dsv4lab is a correctness-first workbench for DeepSeek-V4-Flash inference. This notebook meets it through the
# small checkpoint that ships with the repository: `data/tiny` (random weights with the full architecture — mHC,
# compressed sparse attention, hash-routed and top-k MoE, FP4 experts, FP8 projections), or `data/tiny-py` (the
# same shapes, trained on Python source) when that folder is present.
#
# Every notebook here is a thin narrative over the package: the code cells call `dsv4lab`, results go to
# `RUN_DIR/results/`, figures to `RUN_DIR/figures/`. Run them all headless with `dsv4lab reproduce`.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: scratch/00_quickstart/ (replaced at the next run)
SMOKE: bool = False  # tiny CPU run (what the tests run): fewer generated tokens
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # seed of the sampled continuation
CHECKPOINT: str = ""  # checkpoint folder; empty: data/tiny-py when present, else data/tiny
PROMPT: str = "import os\nimport sys\n\n"  # prompt text (encoded with the checkpoint's tokenizer)
MAX_NEW_TOKENS: int = 48  # tokens to generate (8 in SMOKE mode)
TEMPERATURE: float = 0.8  # sampling temperature of the headline continuation (0: greedy)
TOP_P: float = 0.95  # nucleus (top-p) sampling of the headline continuation

# %%
# %matplotlib inline
from IPython.display import Markdown, display

import dsv4lab
from dsv4lab.faces import plots, runs
from dsv4lab.core.checkpoint import Checkpoint
from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.tools import drill
from dsv4lab.tools.train import quant_ablation

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("00_quickstart", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, SEED=SEED, PROMPT=PROMPT,
                                                            TEMPERATURE=TEMPERATURE, TOP_P=TOP_P))
n_new = 8 if SMOKE else MAX_NEW_TOKENS
print(f"checkpoint {runs.display_path(ckpt)}; writing to {out.run_dir}")

# %% [markdown]
# ## Inspect the checkpoint
#
# `dsv4lab inspect` in code: every expected tensor present with the right dtype and shape, no truncated shard,
# no E8M0 scale byte equal to 0xFF (NaN). The figure shows where the bytes are — routed experts in packed FP4
# (stored as I8), projections in FP8 E4M3 with E8M0 block scales.

# %%
ck = Checkpoint(ckpt)
report = ck.validate(scan_values=True)
inventory = report.inventory.to_dict()
print(ck.args.summary())
print(f"{inventory['tensors']} tensors, {inventory['total_bytes'] / 1e6:.1f} MB; "
      f"{'valid' if report.ok else 'INVALID'} ({len(report.problems)} problems)")
out.keys(checkpoint_ok=report.ok, problems=len(report.problems), tensors=inventory["tensors"],
         total_bytes=inventory["total_bytes"])
out.data("inventory", inventory)
out.figure(plots.plot_checkpoint_inventory(inventory, title=f"{ckpt.name}: bytes by component and stored dtype",
                                           where=dict(model=f"checkpoint {runs.display_path(ckpt)}")), "inventory")

# %% [markdown]
# ## Load and generate
#
# `dsv4lab.load` reads the native checkpoint one tensor at a time (nothing is dequantized at load) and returns a
# runner with per-sequence caches. The reference backend computes in bf16 with the checkpoint's quantization
# simulated (FP8 activations, FP8 KV cache, FP4 indexer keys).
#
# The small model is shown at its best with **nucleus sampling** (`TEMPERATURE`, `TOP_P`, `SEED`: the settings are
# printed with the text). Greedy decoding is what the oracles check — deterministic, so its ids and trajectory hash
# are stable across runs and machines — but a model this small falls into repeating itself under it.

# %%
runner = dsv4lab.load(ckpt, max_batch=1)
prompt_ids = runner.tokenizer.encode(PROMPT, add_bos=True) if runner.tokenizer else [5, 6, 7, 8, 9]
sampled = runner.generate(prompt_ids, n_new, temperature=TEMPERATURE, top_p=TOP_P, seed=SEED)
greedy = runner.generate(prompt_ids, n_new)
decode = runner.tokenizer.decode if runner.tokenizer else (lambda ids: " ".join(map(str, ids)))
out.keys(prompt_tokens=len(prompt_ids), generated_tokens=len(sampled), trajectory_hash=trajectory_hash(greedy))
out.data("generation", dict(prompt=PROMPT, prompt_ids=prompt_ids, temperature=TEMPERATURE, top_p=TOP_P, seed=SEED,
                            sampled_ids=sampled, sampled_text=decode(sampled), greedy_ids=greedy,
                            greedy_text=decode(greedy)))
Markdown(f"**Sampled** — temperature {TEMPERATURE}, top-p {TOP_P}, seed {SEED}, {len(sampled)} new tokens "
         f"(the prompt is the first {len(prompt_ids)} tokens):\n\n```python\n{PROMPT}{decode(sampled)}\n```\n\n"
         f"**Greedy** — temperature 0, trajectory hash `{trajectory_hash(greedy)}`:\n\n"
         f"```python\n{PROMPT}{decode(greedy)}\n```")

# %% [markdown]
# ## The first fixed-token oracle
#
# The paper's correctness work hinged on fixed-token oracles: given fixed prompt ids, the greedy ids must equal
# the recorded ones exactly (its France oracle, reported by the paper). `data/golden/<checkpoint>.json` holds this
# checkpoint's oracles, recorded with the reference backend; `02_correctness` runs the whole hierarchy.

# %%
oracles, source = drill.fixed_id_oracles(ckpt, runner, limit=1, max_new_tokens=8 if SMOKE else None)
rows = drill.run_oracles(runner, oracles)
print(f"expected ids from: {source}")
golden_ok = all(r["ok"] for r in rows) if source.startswith("golden") else None
out.keys(golden_oracle_ok=golden_ok)
out.table("oracle", rows)

# %% [markdown]
# ## What the native number formats cost
#
# DeepSeek-V4-Flash stores routed experts as FP4 E2M1 with one power-of-two (E8M0) scale per 32 weights, and
# dense projections as FP8 E4M3 with one scale per 128×128 block. On the trained small model, each family was
# re-quantized in other formats (`dsv4lab train-small ablation`, computed on CPU; `data/results/quant_ablation.json`):
# FP4 group sizes 16–128 with E8M0 or E4M3 group scales, and dense FP8 with block or per-channel scales. The
# teacher-forced KL against the bf16 model is the sensitive measure (held-out perplexity moves less than its noise).

# %%
ablation = quant_ablation.load_results()
points = ablation["points"] if ablation else []
if not points:
    print("data/results/quant_ablation.json is absent: run `dsv4lab train-small ablation` to produce it")
display(out.table("quant_ablation", [dict(format=p["name"], sweep=p["sweep"], heldout_ppl=p["heldout_ppl"],
                                          kl_vs_bf16=p["kl_vs_bf16"], weight_rel_error=p["weight_rel_error"],
                                          bytes_per_param=p["bytes_per_param"],
                                          checkpoint_choice=p["is_checkpoint_choice"]) for p in points]))
if points:
    display(out.figure(plots.plot_quant_ablation(points), "quant_ablation"))

# %% [markdown]
# ## Where to go next
#
# | notebook | what it shows |
# |---|---|
# | `01_layout_repair` | the paper's W2 layout bug end to end: fault, failing oracle, per-stage cosine, fingerprint, repair |
# | `02_correctness` | the verification hierarchy: kernel, layer and model tiers, teacher-forced divergence at every cache boundary |
# | `03_decode_ablation`, `04_prefill_ablation` | kernel variants: committed H200 measurements, the cost model, an interpreter check on CPU |
# | `05_roofline` | hardware catalogue, the paper's MI250 and our H200 on their rooflines, the account of the paper's 74.5 tok/s, an explorer |
# | `06_paper_figures` | the paper's decode and prefill milestones redrawn, and where this project stands beside them |
