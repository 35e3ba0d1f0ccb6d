# %% [markdown]
# # 05 · The roofline: hardware catalogue, ops on the roofline, and the account of 74.5 tok/s
#
# As reported by the paper, the final DeepSeek-V4-Flash decode on four MI250 GCDs (TP4, batch 1) ran at
# **74.5 tok/s** — about 14% of the bandwidth roofline of the same step. The weights alone are ≈ 11.2 GB per token
# for the whole model (the paper's §5.1), ≈ 3 GB on each of four ranks.
#
# `dsv4lab.perf` turns that into numbers one can check: a hardware catalogue where every figure carries its
# source (`data/hardware/*.yaml`), an op-level cost model (bytes and FLOPs per op of a decode step, per rank
# under TP/EP), and a step-time model with penalty terms that rebuilds the paper's step from the components the
# paper measured.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: a new runs/<UTC stamp>_<commit>/
SMOKE: bool = False  # tiny CPU run (what the tests run); the model is analytic, so nothing changes
INTERACTIVE: bool = False  # show the hardware / TP / batch / context explorer
SEED: int = 0  # unused: the model is deterministic
CHECKPOINT: str = ""  # checkpoint folder (recorded only; the model describes DeepSeek-V4-Flash)
HARDWARE: str = "h200-sxm"  # catalogue entry of the roofline chart
TP: int = 2  # tensor-parallel ranks of the roofline chart
BATCH: int = 1  # decode batch of the roofline chart
CONTEXT: int = 4096  # cached tokens per sequence

# %%
# %matplotlib inline
from dsv4lab import plots, runs
from dsv4lab.config import get_preset
from dsv4lab.perf import account as perf_account
from dsv4lab.perf import roofline
from dsv4lab.perf.hardware import catalogue, load_hardware

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("05_roofline", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, HARDWARE=HARDWARE, TP=TP,
                                                          BATCH=BATCH, CONTEXT=CONTEXT))
flash = get_preset("flash")
hw = load_hardware(HARDWARE)

# %% [markdown]
# ## The hardware catalogue
#
# Datasheet peaks beside measured (achievable) figures; every number in the YAML files names its source.

# %%
cat = catalogue()
out.table("catalogue", [h.summary() for h in cat.values()])

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
summary = [dict(setting=f"{r['hardware']} TP{r['tp']} batch {r['batch']}", bytes_per_token=r["bytes_per_token"],
                bytes_per_token_per_rank=r["bytes_per_token_per_rank"], bound_tok_s=r["bound_tok_s"],
                predicted_tok_s=r["predicted"]["tok_s"], mbu_pct=r["predicted"]["mbu_pct"])
           for r in (paper_setting, report)]
out.keys(flash_bytes_per_token=paper_setting["bytes_per_token"],
         mi250_tp4_bytes_per_token_per_rank=paper_setting["bytes_per_token_per_rank"],
         mi250_tp4_bound_tok_s=paper_setting["bound_tok_s"], chart_predicted_tok_s=report["predicted"]["tok_s"])
out.table("bounds", summary)

# %% [markdown]
# ## The roofline, with the step's ops on it
#
# Each op of one decode step sits at its arithmetic intensity and at the FLOP rate the step-time model gives it
# (penalties included); at batch 1 nearly everything sits far left, where bandwidth and launch overheads rule.

# %%
fig = plots.plot_roofline([hw, load_hardware("mi250-gcd")], report["ops"],
                          title=f"DeepSeek-V4-Flash decode on {hw.name}, TP{TP}, batch {BATCH}, context {CONTEXT}")
out.figure(fig, "roofline")

# %%
fig = plots.plot_bytes_composition({f"{paper_setting['hardware']} TP4 (whole model)": paper_setting["components"],
                                    f"{report['hardware']} TP{TP} (whole model)": report["components"]},
                                   title="Weight bytes per generated token by component")
out.figure(fig, "bytes")

# %% [markdown]
# ## The account of 74.5 tok/s
#
# The paper's final step rebuilt from the component times it reports (routed-MoE stage, attention kernel) and
# the model for everything else, then each decode milestone, and beside them the model's prediction for this
# project's target (two H200s, TP2). Diamonds mark the reported step times.

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
# milestones whose components the model can state (from the paper's component times or implied by a milestone
# pair), in the paper's order; the rest share the final step's components and are left out
modelled = [m for m in account["milestones"] if not m["basis"].startswith("no component time")]
rows = [dict(label=f"{m['label']} (reported {m['reported_tok_s']:g})", components_us=m["components_us"],
             reported_step_us=m["reported_step_us"]) for m in reversed(modelled)]
rows.append(dict(label="model: 2×H200 TP2 (this project's target)", components_us=prediction["components_us"]))
fig = plots.plot_step_waterfall(rows, title="Decode step by component: the paper's milestones and the H200 target")
out.figure(fig, "waterfall")

# %% [markdown]
# ## Explore: hardware, TP, batch and context
#
# (Shown when `INTERACTIVE=True`.) The same roofline and breakdown functions as above, for the setting you pick.

# %%
if INTERACTIVE:
    import ipywidgets as widgets
    from IPython.display import display

    from dsv4lab.config import ConfigError
    from dsv4lab.perf.hardware import HardwareError

    view = widgets.Output()

    def explore(hardware, tp, batch, context):
        with view:
            view.clear_output(wait=True)
            try:
                rep = roofline.roofline_report(flash, load_hardware(hardware), tp=tp, batch=batch, context=context)
            except (ConfigError, HardwareError, roofline.PerfError, ValueError) as err:
                print(f"not a valid setting: {err}")
                return
            print(f"{rep['predicted']['tok_s']:,.1f} tok/s predicted, bound {rep['bound_tok_s']:,.0f} tok/s, "
                  f"{rep['bytes_per_token_per_rank'] / 1e9:.2f} GB per token on the busiest rank")
            display(plots.plot_roofline(hardware, rep["ops"],
                                        title=f"{hardware}, TP{tp}, batch {batch}, context {context}"))
            display(plots.plot_step_waterfall([dict(label=f"{hardware} TP{tp} batch {batch}",
                                                    components_us=rep["predicted"]["components_us"], tokens=batch)]))

    controls = dict(hardware=widgets.Dropdown(options=list(cat), value=HARDWARE, description="hardware"),
                    tp=widgets.Dropdown(options=[1, 2, 4, 8], value=TP, description="TP"),
                    batch=widgets.IntSlider(value=BATCH, min=1, max=64, description="batch"),
                    context=widgets.IntSlider(value=CONTEXT, min=256, max=65536, step=256, description="context"))
    widgets.interactive_output(explore, controls)
    display(widgets.VBox([widgets.HBox(list(controls.values())[:2]), widgets.HBox(list(controls.values())[2:]), view]))

# %%
out.doc["key_results"]
