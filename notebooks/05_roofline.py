# %% [markdown]
# # 05 · The roofline: hardware catalogue, the paper's and our numbers on the roofline, the account of 74.5 tok/s
#
# As reported by the paper, the final DeepSeek-V4-Flash decode on four MI250 GCDs (TP4, batch 1) ran at
# **74.5 tok/s** — about 14% of the bandwidth roofline of the same step. The weights alone are ≈ 11.2 GB per token
# for the whole model (the paper's §5.1), ≈ 3 GB on each of four ranks.
#
# `dsv4lab.tools.perf` turns that into numbers one can check: a hardware catalogue where every figure carries its
# source (`data/hardware/*.yaml`), an op-level cost model (bytes and FLOPs per op of a decode step, per rank
# under TP/EP), and a step-time model with penalty terms that rebuilds the paper's step from the components the
# paper measured. Every figure says which of its numbers are **reported by the paper**, **measured** by this
# project (on the H200, committed under `data/results/h200/`) or **modelled**.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: scratch/05_roofline/ (replaced at the next run)
SMOKE: bool = False  # tiny CPU run (what the tests run); the model is analytic, so nothing changes
INTERACTIVE: bool = False  # show the hardware / TP / EP / batch / context explorer
SEED: int = 0  # unused: the model is deterministic
CHECKPOINT: str = ""  # checkpoint folder (recorded only; the model describes DeepSeek-V4-Flash)
GPU: str = "h200"  # results folder of our measurements under data/results/
HARDWARE: str = "h200-sxm"  # catalogue entry of the roofline chart's right panel and the explorer
TP: int = 1  # tensor-parallel ranks of the chart's modelled ops (the measured kernels ran on one GPU)
EP: int = 1  # expert-parallel ranks of the explorer's first setting
BATCH: int = 1  # decode batch of the chart's modelled ops
CONTEXT: int = 4096  # cached tokens per sequence

# %%
# %matplotlib inline
from IPython.display import HTML, display

from dsv4lab.faces import figure_data, plots, runs
from dsv4lab.core.config import get_preset
from dsv4lab.tools.perf import account as perf_account
from dsv4lab.tools.perf import roofline
from dsv4lab.tools.perf.hardware import catalogue, load_hardware

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("05_roofline", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, GPU=GPU, HARDWARE=HARDWARE,
                                                          TP=TP, EP=EP, BATCH=BATCH, CONTEXT=CONTEXT))
flash = get_preset("flash")
hw = load_hardware(HARDWARE)

# %% [markdown]
# ## The hardware catalogue
#
# Datasheet peaks beside measured (achievable) figures; every number in the YAML files names its source.

# %%
cat = catalogue()
out.table("catalogue", [h.summary() for h in cat.values()],
          ["name", "memory.bw_peak_gbps", "memory.bw_achievable_gbps", "matrix_tflops.bf16", "matrix_tflops.fp8",
           "matrix_tflops.int8", "launch.kernel_overhead_us"])

# %%
out.figure(plots.plot_hardware_catalogue(list(cat.values())), "catalogue")

# %% [markdown]
# ## Bytes per token and the bound
#
# The paper's setting first (MI250 GCD, TP4, batch 1): the whole-model weight traffic per token, the bytes on the
# busiest rank and the roofline bound. Then the chart's setting (`HARDWARE`, `TP`, `BATCH`, `CONTEXT`).

# %%
paper_setting = roofline.roofline_report(flash, load_hardware("mi250-gcd"), tp=4, batch=1, context=CONTEXT)
report = roofline.roofline_report(flash, hw, tp=TP, batch=BATCH, context=CONTEXT)
summary = [dict(setting=f"{r['hardware']} TP{r['tp']} batch {r['batch']}", GB_per_token=r["bytes_per_token"] / 1e9,
                GB_per_token_per_rank=r["bytes_per_token_per_rank"] / 1e9, bound_tok_s=r["bound_tok_s"],
                predicted_tok_s=r["predicted"]["tok_s"], mbu_pct=r["predicted"]["mbu_pct"])
           for r in (paper_setting, report)]
out.keys(flash_bytes_per_token=paper_setting["bytes_per_token"],
         mi250_tp4_bytes_per_token_per_rank=paper_setting["bytes_per_token_per_rank"],
         mi250_tp4_bound_tok_s=paper_setting["bound_tok_s"], chart_predicted_tok_s=report["predicted"]["tok_s"])
out.table("bounds", summary)

# %% [markdown]
# ## The roofline, on the hardware each number comes from
#
# Left, the paper's MI250 GCD: its reported times (black squares) placed at the arithmetic intensity of the same
# work — the whole decode step at 74.5 tok/s, the routed-MoE stage, the attention kernel, the M=2048 MoE prefill
# and the whole prefill. Right, this project's H200: the measured decode kernels (the best variant of each), the
# FP8 prefill GEMMs and the grouped MoE at 4,096 tokens, and the whole decode step of the one-GPU end-to-end run
# when it is committed. On both, the modelled ops of one decode step (hollow grey) at the rate the step-time model
# gives them: at batch 1 nearly everything sits far left, where bandwidth and launch overheads rule.

# %%
panels, where = figure_data.roofline_panels(HARDWARE, tp=TP, batch=BATCH, context=CONTEXT, gpu=GPU)
out.keys(roofline_measured_points=sum(p["source"] == "measured" for p in panels[1]["points"]),
         roofline_reported_points=sum(p["source"] == "reported" for p in panels[0]["points"]))
out.table("roofline_points", [dict(panel=pan["hardware"].name, **{k: pt[k] for k in ("source", "group", "label",
                                                                                         "intensity", "tflops")})
                              for pan in panels for pt in pan["points"] if pt["source"] != "modelled"])
fig = plots.plot_roofline(panels, where=where,
                          title="DeepSeek-V4-Flash on the roofline: the paper's MI250 GCD and this project's "
                                f"{hw.name}")
out.figure(fig, "roofline")

# %%
fig = plots.plot_bytes_composition(
    {"whole model (§5.1 accounting)": paper_setting["components"],
     "busiest GCD, 4×MI250 TP4 (the paper's layout)": figure_data.bytes_by_component(flash, tp=4, context=CONTEXT,
                                                                                     sharding="sglang"),
     "busiest GPU, 2×H200 TP2 (dsv4lab's layout)": figure_data.bytes_by_component(flash, tp=2, context=CONTEXT,
                                                                                  sharding="reference")},
    title="Bytes per generated token by component: the whole model and the busiest rank (modelled)",
    where=dict(note=f"context {CONTEXT} tokens"))
out.figure(fig, "bytes")

# %% [markdown]
# ## The account of 74.5 tok/s
#
# The paper's final step rebuilt from the component times it reports (routed-MoE stage, attention kernel) and
# the model for everything else, then walked back through all six decode milestones, and beside them the
# model's prediction for this project's target (two H200s, TP2). The columns print each kind of number beside
# its own kind: the paper's reported tok/s (the black squares mark its step time), the model's, and their ratio.
# Two milestones changed things the paper gave no component time for: the model has nothing of its own to say
# there and says so.

# %%
account = perf_account.paper_account()
prediction = perf_account.predict_account("h200-sxm")
print(account["bandwidth"]["statement"])
print(f"reported {account['reported_tok_s']} tok/s; rebuilt {account['predicted_tok_s']:.1f} tok/s "
      f"({account['error_pct']:+.1f}%), input ranges give {account['range_tok_s']['slow']:.1f}–"
      f"{account['range_tok_s']['fast']:.1f} tok/s")
out.keys(paper_account_predicted_tok_s=account["predicted_tok_s"], paper_account_error_pct=account["error_pct"],
         paper_bandwidth_utilization_pct=account["bandwidth"]["utilization_pct"],
         h200_tp2_predicted_tok_s=prediction["predicted_tok_s"])
out.table("account", [dict(component=k, us=v, share_pct=100 * account["components_share"][k])
                      for k, v in account["components_us"].items()])

# %%
rows = figure_data.milestone_rows(GPU)
for r in rows[:-1]:  # the paper's milestones: their short names (the full ones are in data/paper/)
    r["label"] = plots.headline(r["label"])
out.keys(waterfall_milestones=len(rows) - 1)
fig = plots.plot_step_waterfall(
    rows, title="Decode step by component: the paper's six milestones and the H200 target (tok/s at batch 1)",
    where=dict(modelled="cost model on mi250-gcd (TP4, the paper's layout) and h200-sxm (TP2)",
               reported="data/paper/ (4×MI250 GCD, TP4, batch 1)",
               note="MI250 bars: the routed-MoE and attention segments are the paper's reported component times"))
out.figure(fig, "waterfall")

# %% [markdown]
# ## Explore: hardware, TP, EP, batch and context
#
# (Shown when `INTERACTIVE=True`.) Pick a setting: the bound and the predicted step, the step's account by
# component, and the same roofline and waterfall functions as above for that setting.

# %%
if INTERACTIVE:
    import ipywidgets as widgets

    from dsv4lab.core.errors import DSV4LabError

    view = widgets.Output()

    def explore(hardware, tp, ep, batch, context):
        with view:
            view.clear_output(wait=True)
            try:
                h = load_hardware(hardware)
                rep = roofline.roofline_report(flash, h, tp=tp, ep=ep, batch=batch, context=context)
                acc = perf_account.predict_account(h, tp=tp, ep=ep, batch=batch, context=context)
            except (DSV4LabError, ValueError) as err:
                print(f"not a valid setting: {err}")
                return
            display(HTML(f"<b>{hardware}, TP{tp} EP{ep}, batch {batch}, context {context:,}</b> (modelled): "
                         f"bound {rep['bound_tok_s']:,.0f} tok/s · predicted {acc['predicted_tok_s']:,.1f} tok/s "
                         f"(step {acc['step_us'] / 1e3:.2f} ms, {acc['mbu_pct']:.1f}% of the bandwidth) · "
                         f"{rep['bytes_per_token_per_rank'] / 1e9:.2f} GB per token on the busiest rank"))
            display(runs.Table([dict(component=k, us=v, share_pct=100 * acc["components_share"][k])
                                for k, v in acc["components_us"].items()]))
            display(plots.plot_roofline([dict(hardware=h, title=f"{hardware}, TP{tp} EP{ep}, batch {batch}",
                                              points=figure_data.step_points(rep, "ops of one decode step"))],
                                        title=f"Roofline of one decode step on {hardware}",
                                        where=dict(modelled=f"cost model on {hardware}, context {context}")))
            display(plots.plot_step_waterfall([dict(label=f"{hardware} TP{tp} EP{ep}", tokens=batch,
                                                    components_us=acc["components_us"])],
                                              title="Predicted step by component",
                                              where=dict(modelled=f"cost model on {hardware}")))

    controls = dict(hardware=widgets.Dropdown(options=list(cat), value=HARDWARE, description="hardware"),
                    tp=widgets.Dropdown(options=[1, 2, 4, 8], value=TP, description="TP"),
                    ep=widgets.Dropdown(options=[1, 2, 4, 8], value=EP, description="EP"),
                    batch=widgets.IntSlider(value=BATCH, min=1, max=64, description="batch"),
                    context=widgets.IntSlider(value=CONTEXT, min=256, max=65536, step=256, description="context"))
    widgets.interactive_output(explore, controls)
    display(widgets.VBox([widgets.HBox(list(controls.values())[:3]), widgets.HBox(list(controls.values())[3:]), view]))

# %%
out.summary()
