# %% [markdown]
# # 06 · The paper's milestone figures, redrawn beside the model and our measurements
#
# The paper reports its optimisation history as two progress figures (reported by the paper; transcribed in
# `data/paper/`): decode tok/s on four MI250 GCDs (TP4, batch 1) from 14.6 to 74.5, and prefill input tok/s for
# a 4,604-token prompt from 1,336 to 2,234. They are redrawn here from the YAML, with the cost model's value for
# each milestone beside the reported one (hollow where the model has no component time for that change), the
# model's prediction for this project's H200 target, and our own end-to-end measurements when
# `data/results/h200/e2e.json` is committed.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: a new runs/<UTC stamp>_<commit>/
SMOKE: bool = False  # tiny CPU run (what the tests run); the figures are cheap, so nothing changes
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # unused: nothing here is random
CHECKPOINT: str = ""  # checkpoint folder (recorded only)
GPU: str = "h200"  # results folder of our measurements under data/results/

# %%
# %matplotlib inline
from dsv4lab import measurements, plots, runs
from dsv4lab.perf import account as perf_account

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("06_paper_figures", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, GPU=GPU))
headline = perf_account.load_paper("headline")
account = perf_account.paper_account()
prediction = perf_account.predict_account("h200-sxm")
e2e = measurements.e2e_headline(measurements.load_results_file("e2e", GPU))
print("our end-to-end measurements: " + (", ".join(f"{k} {v:g}" for k, v in e2e.items()) if e2e else
                                         f"none committed ({measurements.results_path('e2e', GPU)} is absent)"))

# %% [markdown]
# ## Decode milestones

# %%
decode = perf_account.load_paper("decode_milestones")["milestones"]
modelled = {m["id"]: m for m in account["milestones"]}
decode_rows = [dict(id=m["id"], label=m["label"], tok_s=m["tok_s"], tok_s_range=m.get("tok_s_range"),
                    modelled_tok_s=modelled.get(m["id"], {}).get("predicted_tok_s"),
                    independent=modelled.get(m["id"], {}).get("independent", False),
                    basis=modelled.get(m["id"], {}).get("basis")) for m in decode]
lines = {"model: 2×H200 TP2 (target)": prediction["predicted_tok_s"],
         "later audit, MI250 TP4 (reported by the paper)": sum(headline["audit"]["tok_s_range"]) / 2}
if "decode_tok_s" in e2e:
    lines[f"dsv4lab measured on {GPU.upper()}"] = e2e["decode_tok_s"]
out.keys(decode_milestones=len(decode), final_decode_reported_tok_s=decode[-1]["tok_s"],
         final_decode_modelled_tok_s=decode_rows[-1]["modelled_tok_s"], decode_measured_tok_s=e2e.get("decode_tok_s"))
out.table("decode", decode_rows, ["id", "label", "tok_s", "modelled_tok_s", "independent", "basis"])
fig = plots.plot_milestones(decode_rows, value="tok_s", unit="decode tok/s (batch 1)", predicted="modelled_tok_s",
                            lines=lines, title="Decode milestones, 4×MI250 GCD TP4 (reported by the paper)")
out.figure(fig, "decode")

# %% [markdown]
# ## Prefill milestones

# %%
prefill = perf_account.load_paper("prefill_milestones")
prefill_rows = [dict(id=m["id"], label=m["label"], input_tok_s=m["input_tok_s"], ttft_s=m["ttft_s"])
                for m in prefill["milestones"]]
lines = {"model: MI250 TP4, same prompt": account["prefill"]["model_input_tok_s"]}
for key in ("prefill_input_tok_s", "prefill_tok_s"):
    if key in e2e:
        lines[f"dsv4lab measured on {GPU.upper()}"] = e2e[key]
        break
out.keys(prefill_milestones=len(prefill_rows), final_prefill_reported_input_tok_s=prefill_rows[-1]["input_tok_s"],
         prefill_modelled_input_tok_s=account["prefill"]["model_input_tok_s"])
out.table("prefill", prefill_rows)
pf = account["prefill"]
print(f"reported {pf['reported_input_tok_s']:,} input tok/s = {pf['achieved_tflops_all_gcds']:.1f} TFLOP/s on four "
      "GCDs, "
      f"{pf['mfma_utilization_pct']:.1f}% of their BF16 matrix peak; the cost model, which charges bytes and peak "
      f"FLOPs with penalties, allows {pf['model_input_tok_s']:,.0f}. {pf.get('note', '')}")
fig = plots.plot_milestones(prefill_rows, value="input_tok_s", unit="prefill input tok/s", lines=lines,
                            title=f"Prefill milestones, {prefill['prompt_tokens']:,}-token prompt, 4×MI250 GCD TP4 "
                                  "(reported by the paper)")
out.figure(fig, "prefill")

# %%
out.doc["key_results"]
