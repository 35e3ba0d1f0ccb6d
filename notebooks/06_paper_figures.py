# %% [markdown]
# # 06 · The paper's milestone figures, and where this project stands beside them
#
# The paper reports its optimisation history as two progress figures (reported by the paper; transcribed in
# `data/paper/`): decode tok/s on four MI250 GCDs (TP4, batch 1) from 14.6 to 74.5, and prefill input tok/s for
# a 4,604-token prompt from 1,336 to 2,234. Each figure redraws them from the YAML with the cost model's value
# per milestone, and sets beside them where this project stands: the paper's final number, this project's
# end-to-end measurements on the H200 (one GPU with a `--layers` cut of the model that fits it, two GPUs with the
# whole model), and the model's prediction — each with the roofline bound of its own setting and the share of it
# reached. A measurement that is not committed yet is said so in the figure, never filled in.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: scratch/06_paper_figures/ (replaced at the next run)
SMOKE: bool = False  # tiny CPU run (what the tests run); the figures are cheap, so nothing changes
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # unused: nothing here is random
CHECKPOINT: str = ""  # checkpoint folder (recorded only)
GPU: str = "h200"  # results folder of our measurements under data/results/

# %%
# %matplotlib inline
from dsv4lab.faces import figure_data, plots, runs
from dsv4lab.tools.perf import account as perf_account

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("06_paper_figures", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, GPU=GPU))
headline = perf_account.load_paper("headline")
account = perf_account.paper_account()
e2e = figure_data.e2e_runs(GPU)
measured = "; ".join(r["provenance"] for r in e2e if r["present"]) or None
out.keys(e2e_runs_committed=sum(r["present"] for r in e2e))
out.table("e2e", [dict(file=r["file"], present=r["present"], setting=r.get("label") or r["what"],
                       decode_tok_s=r.get("decode_tok_s"), mbu=r.get("mbu"), ttft_s=r.get("ttft_s"),
                       measured_on=r.get("provenance"), command=None if r["present"] else r["command"]) for r in e2e])

# %% [markdown]
# ## Decode

# %%
decode = perf_account.load_paper("decode_milestones")["milestones"]
modelled = {m["id"]: m for m in account["milestones"]}
decode_rows = [dict(id=m["id"], label=plots.headline(m["label"]), tok_s=m["tok_s"], tok_s_range=m.get("tok_s_range"),
                    modelled_tok_s=modelled.get(m["id"], {}).get("predicted_tok_s"),
                    independent=modelled.get(m["id"], {}).get("independent", False),
                    basis=modelled.get(m["id"], {}).get("basis")) for m in decode]
standing = figure_data.decode_standing(GPU)
measured_decode = next((r["value"] for r in standing if r["source"] == "measured" and r.get("value")), None)
out.keys(decode_milestones=len(decode), final_decode_reported_tok_s=decode[-1]["tok_s"],
         final_decode_modelled_tok_s=decode_rows[-1]["modelled_tok_s"], decode_measured_tok_s=measured_decode)
out.table("decode", decode_rows, ["id", "label", "tok_s", "modelled_tok_s", "independent", "basis"])
out.table("decode_standing", [dict(system=r["label"], kind=r["source"], tok_s=r.get("value"), bound_tok_s=r.get("bound"),
                                   pct_of_bound=100 * r["value"] / r["bound"] if r.get("value") and r.get("bound")
                                   else None, note=r.get("missing")) for r in standing])
audit = sum(headline["audit"]["tok_s_range"]) / 2
fig = plots.plot_milestones(decode_rows, value="tok_s", unit="decode tok/s (batch 1)", predicted="modelled_tok_s",
                            lines={"a later audit of the final checkpoint, 54–56": dict(value=audit, source="reported")},
                            standing=standing,
                            title="Decode, batch 1: the paper's milestones on 4×MI250, and where this project stands",
                            where=dict(measured=measured, modelled="cost model (dsv4lab.tools.perf), bounds at peak "
                                                                   "bandwidth of each setting"))
out.figure(fig, "decode")

# %% [markdown]
# ## Prefill (TTFT of the paper's 4,604-token prompt)
#
# The paper's prefill milestones, and the model's rate for the same prompt and setting — about four times the
# paper's final 2,234 input tok/s (the gap is marked): the model runs the GEMMs at peak matrix rates, while the
# paper's M=2048 routed-MoE kernels reach a small fraction of the INT8 peak (see `04_prefill_ablation`). Beside
# them, this project's measured time to first token where committed.

# %%
prefill = perf_account.load_paper("prefill_milestones")
prefill_rows = [dict(id=m["id"], label=plots.headline(m["label"]), input_tok_s=m["input_tok_s"], ttft_s=m["ttft_s"])
                for m in prefill["milestones"]]
pf = account["prefill"]
standing = figure_data.prefill_standing(GPU)
measured_ttft = next((r["ttft_s"] for r in standing if r["source"] == "measured" and r.get("value")), None)
out.keys(prefill_milestones=len(prefill_rows), final_prefill_reported_input_tok_s=prefill_rows[-1]["input_tok_s"],
         prefill_modelled_input_tok_s=pf["model_input_tok_s"], ttft_measured_s=measured_ttft)
out.table("prefill", prefill_rows)
print(f"reported {pf['reported_input_tok_s']:,.0f} input tok/s = {pf['achieved_tflops_all_gcds']:.1f} TFLOP/s on four "
      f"GCDs, {pf['mfma_utilization_pct']:.1f}% of their BF16 matrix peak; the cost model, which charges bytes and "
      f"peak FLOPs with penalties, allows {pf['model_input_tok_s']:,.0f}. {pf.get('note', '')}")
fig = plots.plot_milestones(prefill_rows, value="input_tok_s", unit="prefill input tok/s",
                            lines={"cost model, same prompt and setting": dict(value=pf["model_input_tok_s"],
                                                                              source="modelled", gap=True)},
                            standing=standing,
                            title=f"Prefill of a {prefill['prompt_tokens']:,}-token prompt: the paper's milestones "
                                  "on 4×MI250, and where this project stands",
                            where=dict(measured=measured, modelled="cost model (dsv4lab.tools.perf)"))
out.figure(fig, "prefill")

# %%
out.summary()
