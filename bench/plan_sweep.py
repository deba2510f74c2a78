"""The recommender against measured runs on one host's GPUs: `dyad plan --gpus N --profile P`'s
candidates for a config (dyad/app/recommend.py: every split E+L of the GPUs between the pools,
colocated with each pool's own layout, homogeneous with one layout), each run for real, reported
by placement with the best of each, the best heterogeneous one against the best homogeneous one
(tokens/s), and whether the recommender's pick is within `--within` (5 %) of the best measured.

Which candidates run: those predicted to fit (the memory estimate against the profile's GPU),
the `--per-placement` best predicted of each placement (every split counts as one placement;
default 3, 0: all) and the pick. Each run as bench/e2e_hetero.py's `run_layout` runs a layout:
the config with the candidate's fields (`Candidate.overrides`), `--steps` steps of which the
first `--skip` are left out of the medians, stopped before a final checkpoint; tokens/s, model
TFLOP/s per GPU over both modules, the exposed boundary waits and each pool's peak memory. A
candidate that fails (out of memory, say) is reported with its error and counts as not measured.

    python bench/module_profile.py CONFIG [KEY=VALUE ...] --out $OUT/profile.json          # one GPU
    NCCL_NVLS_ENABLE=0 python bench/plan_sweep.py CONFIG [KEY=VALUE ...] --gpus 8 \\
        --profile $OUT/profile.json --out $OUT/plan_sweep.json --plot $OUT/plan_sweep.png --work $OUT/runs
    python bench/plan_sweep.py --toy --profile profile.json   # CPU, digits on two ranks (CI)

CONFIG and its overrides as `dyad plan` takes them; they apply to every run (add
train.compile=true there for compiled blocks). The JSON holds every prediction, every run, the
best of each placement and the check.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from e2e_hetero import print_table, run_layout, write_results  # beside this script

from dyad import config as config_lib
from dyad.app.module_costs import load_profile
from dyad.app.recommend import H200, Prediction, recommend
from dyad.data import make_dataset

TOY = ["train.global_batch=8", "train.device=cpu"]


def placement_kind(prediction: Prediction) -> str:
    """"split" for any E+L, else "colocated" or "homogeneous"."""
    return "split" if not prediction.candidate.colocated else prediction.candidate.placement


def chosen(predictions: list[Prediction], per_placement: int) -> list[Prediction]:
    """The pick and the best `per_placement` predicted of each placement kind (0: every one),
    among those that can run, fastest predicted first."""
    runnable = [p for p in predictions if not p.excluded]
    if not per_placement:
        return runnable
    taken, counts = [], {}
    for prediction in runnable:
        kind = placement_kind(prediction)
        if counts.get(kind, 0) < per_placement or prediction is runnable[0]:
            taken.append(prediction)
            counts[kind] = counts.get(kind, 0) + 1
    return taken


def candidate_name(prediction: Prediction) -> str:
    """'2+6 enc dp2 tp1 | llm tp1 cp1 dp6 ep2 etp1 mb4'."""
    c = prediction.candidate
    e, m = c.encoder, c.llm
    return (f"{c.placement} enc dp{e.dp} tp{e.tp} | llm tp{m.tp} cp{m.cp} dp{m.dp} ep{m.ep} etp{m.etp}"
            f" mb{c.microbatches}")


def best_of(runs: dict[str, dict], kinds: dict[str, str], kind: str | None = None) -> str | None:
    """The measured run with the most tokens/s (of one placement kind, or of all)."""
    measured = {name: r["tokens_per_s"] for name, r in runs.items()
                if "error" not in r and (kind is None or kinds[name] == kind)}
    return max(measured, key=measured.get) if measured else None


def check(runs: dict[str, dict], kinds: dict[str, str], pick: str, within: float) -> dict:
    """The best run of each placement, the best heterogeneous (split or colocated) against the best
    homogeneous, and the pick's tokens/s against the best's."""
    best = {kind: best_of(runs, kinds, kind) for kind in ("split", "colocated", "homogeneous")}
    overall = best_of(runs, kinds)
    result = {"best": best, "best_overall": overall, "pick": pick}
    tokens = {name: runs[name]["tokens_per_s"] for name in (*best.values(), overall, pick)
              if name is not None and "error" not in runs[name]}
    heterogeneous = [tokens[best[k]] for k in ("split", "colocated") if best[k] is not None]
    if heterogeneous and best["homogeneous"] is not None:
        result["heterogeneous_over_homogeneous"] = max(heterogeneous) / tokens[best["homogeneous"]]
    if overall is not None and pick in tokens:
        result["pick_over_best"] = tokens[pick] / tokens[overall]
        result["pick_within"] = result["pick_over_best"] >= 1 - within
    return result


KIND_COLORS = {"split": "C0", "colocated": "C1", "homogeneous": "C2"}


def plot(path: str, runs: dict[str, dict], kinds: dict[str, str], summary: dict, gpus: int) -> None:
    """Two panels: each run's measured tokens/s (a bar per candidate, colored by placement, the
    pick outlined, a failed run labelled), and measured against predicted tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    measured = [runs[n].get("tokens_per_s", 0.0) for n in names]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(16, 0.4 * len(names) + 2.5), layout="constrained",
                                        gridspec_kw={"width_ratios": [3, 2]})
    colors = [KIND_COLORS[kinds[n]] for n in names]
    drawn = bars.barh(range(len(names)), measured, color=colors)
    for bar, name in zip(drawn, names):
        if name == summary["pick"]:
            bar.set_edgecolor("black")
            bar.set_linewidth(2)
        if "error" in runs[name]:
            bars.text(0, bar.get_y() + bar.get_height() / 2, " failed", va="center")
    bars.set_yticks(range(len(names)), names, fontsize=7)
    bars.invert_yaxis()
    bars.set_xlabel("measured tokens/s")
    bars.set_title(f"{gpus} GPUs: each candidate run (outlined: dyad plan's pick)")
    for kind, color in KIND_COLORS.items():
        points = [(runs[n]["predicted_tokens_per_s"], runs[n]["tokens_per_s"]) for n in names
                  if kinds[n] == kind and "error" not in runs[n]]
        if points:
            scatter.scatter(*zip(*points), color=color, label=kind)
    top = max([*measured, *(r["predicted_tokens_per_s"] for r in runs.values())], default=1.0)
    scatter.plot([0, top], [0, top], color="grey", linewidth=0.8, label="measured = predicted")
    scatter.set_xlabel("predicted tokens/s")
    scatter.set_ylabel("measured tokens/s")
    scatter.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a YAML run config, or the NAME of one dyad ships (default: digits)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--toy", action="store_true", help="CPU, digits, two ranks (CI)")
    parser.add_argument("--gpus", type=int, help="GPUs to split (default: every GPU of this host; toy: 2)")
    parser.add_argument("--profile", required=True, help="bench/module_profile.py's JSON for the same config")
    parser.add_argument("--per-placement", type=int, default=3, help="best predicted candidates run per placement (0: all)")
    parser.add_argument("--within", type=float, default=0.05, help="the pick's allowed shortfall against the best measured")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    parser.add_argument("--work", help="run directories (default: a temporary one)")
    parser.add_argument("--out")
    parser.add_argument("--plot", help="a PNG of the runs' tokens/s and measured against predicted")
    args = parser.parse_args()
    if args.config and "=" in args.config:  # no config named: the first argument is an override
        args.overrides, args.config = [args.config, *args.overrides], None
    overrides = list(args.overrides)
    if args.toy:
        gpus, overrides, args.steps, args.skip = 2, [*TOY, *overrides], 3, 1
    else:
        import torch

        gpus = args.gpus or torch.cuda.device_count()
    config = config_lib.load(args.config, overrides)
    dataset = make_dataset(config.data)
    resolved = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    costs = load_profile(args.profile, resolved)
    predictions = recommend(resolved, dataset, costs, gpus, device_memory=costs.device_memory_gib)
    runnable = [p for p in predictions if not p.excluded]
    if not runnable:
        raise SystemExit(f"no candidate of {gpus} GPUs fits: {predictions[0].excluded if predictions else 'none'}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the router's workers inherit it
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-plan-sweep-"))
    pick = candidate_name(runnable[0])
    predicted = {candidate_name(p): {"placement": p.candidate.placement, "tokens_per_s": p.tokens_per_s,
                                     "step_s": p.step_s, "memory_gib": p.memory_gib} for p in runnable}
    runs, kinds = {}, {candidate_name(p): placement_kind(p) for p in runnable}
    for prediction in chosen(predictions, args.per_placement):
        name = candidate_name(prediction)
        fields = prediction.candidate.overrides(resolved, gpus, H200)
        runs[name] = run_layout(overrides, fields, name, gpus, args.steps, args.skip, work,
                                config_name=args.config) | {
            "predicted_tokens_per_s": prediction.tokens_per_s}
        summary = check(runs, kinds, pick, args.within)
        if args.out:
            write_results(args.out, args.toy, overrides, config_name=args.config or "digits", gpus=gpus,
                          predicted=predicted, runs=runs, check=summary)
    print_table(runs)
    summary = check(runs, kinds, pick, args.within)
    if args.plot:
        plot(args.plot, runs, kinds, summary, gpus)
    for kind, name in summary["best"].items():
        if name:
            print(f"best {kind}: {name}, {runs[name]['tokens_per_s']:.0f} tokens/s "
                  f"(predicted {runs[name]['predicted_tokens_per_s']:.0f})")
    if "heterogeneous_over_homogeneous" in summary:
        print(f"best heterogeneous / best homogeneous: {summary['heterogeneous_over_homogeneous']:.3f}x")
    if "pick_over_best" in summary:
        verdict = "within" if summary["pick_within"] else "NOT within"
        print(f"the pick, {pick}: {summary['pick_over_best']:.3f} of the best measured ({verdict} {args.within:.0%})")


if __name__ == "__main__":
    main()
