"""The pictures of docs/performance.md, drawn from the result files that `bench/` scripts wrote.

    python bench/plots.py                      # reads docs/results, writes the PNGs there
    python bench/plots.py --results DIR --out DIR

- `moe_layer_runs.png`: each interleaved run of `bench/moe_layer.py` with the current layer code
  (its JSON), dyad's interleaved layer against torchtitan's, from an idle GPU and with the host
  ahead, beside the goal (torchtitan's time in the same run over 1.2): a run's spread reads better
  as points than as a table.
- `e2e_two_gpus.png`: tokens/s of `bench/e2e_hetero.py`, one group of bars per comparison (448,
  560 and 672 pixels on two H200s, 448 pixels on two H100s), one bar per layout it measured (a
  layout that failed in a run, e.g. out of memory, is labelled so).
- `e2e_560_two_gpus.png`: every 560-pixel invocation on two H200s (dp2 against one GPU a pool, two
  and three rounds ahead, the next step sent with the update or not), tokens/s and the LLM GPU's
  wait for rows, one point each.

Only the files named in MOE_RUNS and E2E_RUNS and those under E2E_560_STARTS are read; a missing
one is an error naming it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

GOAL = 1.2  # the performance issue's bound: dyad's layer at least 1.2x faster than torchtitan's
PEER = "torchtitan-0.3.0"
DYAD_LAYERS = {"dyad": ("C0", "dyad"), "dyad-gate-up-interleaved": ("C2", "dyad, interleaved gate-up")}
ROUTE_ONE_LAUNCH = "moe_route_one_launch_h200"
MOE_RUNS = {  # label: result file under --results, every run interleaved with the host ahead too
    # The router in one launch, the layer's code since (docs/performance.md, "MoE layer"): one
    # start with HF's block too, a second with QuACK (S) and without it (N), then the current code.
    **{f"H200 R{run}": f"{ROUTE_ONE_LAUNCH}/moe_layer_run{run}.json" for run in (1, 2, 3)},
    **{f"H200 S{run}": f"{ROUTE_ONE_LAUNCH}/start2/quack_run{run}.json" for run in (1, 2)},
    **{f"H200 N{run} (no QuACK)": f"{ROUTE_ONE_LAUNCH}/start2/plain_run{run}.json" for run in (1, 2)},
    "H200 C1": "current_code_h200/moe_layer_run1.json",
    "H200 C2": "current_code_h200/moe_layer_run2.json",
}
SEND_AHEAD = "e2e_send_ahead_depth_2xh200/start2"
RECOMPUTE_H100 = "e2e_recompute_h100/start_1"
E2E_RUNS = {  # label: one result file, or several whose layouts together make the run
    "H200, 448 px, 16 samples": (f"{SEND_AHEAD}/call1/e2e-16-5-heterogeneous-ahead.json",
                                 f"{SEND_AHEAD}/call1/e2e-16-6-homogeneous-colocated-ahead.json"),
    "H200, 560 px, 2 rounds ahead": (f"{SEND_AHEAD}/call1/e2e-64-1-homogeneous-colocated-ahead.json",
                                     f"{SEND_AHEAD}/call1/e2e-64-2-heterogeneous-ahead.json"),
    "H200, 560 px, 3 rounds ahead": (f"{SEND_AHEAD}/call3/e2e-64-1-homogeneous-colocated-d3.json",
                                     f"{SEND_AHEAD}/call3/e2e-64-2-heterogeneous-d3.json"),
    "H200, 672 px, 32 samples": ("e2e_672_2xh200/e2e-32-heterogeneous.json",
                                 "e2e_672_2xh200/e2e-32-homogeneous-colocated.json"),
    "H200, 672 px, 64 samples": ("e2e_672_2xh200/e2e-64-homogeneous-colocated.json",
                                 "e2e_672_2xh200/e2e-64-heterogeneous.json"),
    # Two H100s, where dp2 fits 32 and 64 samples a step only with its encoder's blocks recomputing.
    "H100, 448 px, 64 samples a": (f"{RECOMPUTE_H100}/e2e_0-r64.json", f"{RECOMPUTE_H100}/e2e_1-h64.json"),
    "H100, 448 px, 64 samples b": (f"{RECOMPUTE_H100}/e2e_3-h64.json", f"{RECOMPUTE_H100}/e2e_4-r64.json"),
    "H100, 448 px, 32 samples a": (f"{RECOMPUTE_H100}/e2e_5-r32.json", f"{RECOMPUTE_H100}/e2e_6-h32.json"),
    "H100, 448 px, 32 samples b": (f"{RECOMPUTE_H100}/e2e_7-h32.json", f"{RECOMPUTE_H100}/e2e_8-r32.json"),
}
E2E_560_STARTS = {  # machine start: the folder of its 560-pixel invocations, one layout each
    f"start {n}": f"e2e_send_ahead_depth_2xh200/start{n}" for n in (1, 2, 3)
}
E2E_560_FILES = "**/e2e-64-*.json"  # 64 samples a step; the folders' e2e-16-* files are 448-pixel runs
LAYOUT_NAMES = {"homogeneous-colocated": "(a) dp2", "heterogeneous": "(b) one GPU a pool"}


def load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise FileNotFoundError(f"result file {path} is missing (see MOE_RUNS / E2E_RUNS in bench/plots.py)")
    return json.loads(path.read_text())


def moe_points(results: Path, shape: str) -> list[tuple[str, dict]]:
    """(run label, {layer: {"ms", "ms_host_ahead"}}) for every run that timed `shape` with dyad and the peer."""
    points = []
    for label, name in MOE_RUNS.items():
        layers = load(results, name)["shapes"].get(shape, {})
        if PEER in layers and any(layer in layers for layer in DYAD_LAYERS):
            points.append((label, layers))
    return points


def plot_moe_runs(results: Path, out: Path, shapes=("mixtral-like", "qwen3-like")) -> Path:
    fig, axes = plt.subplots(1, len(shapes), figsize=(7.5 * len(shapes), 4.6))
    for ax, shape in zip(axes, shapes):
        points = moe_points(results, shape)
        xs = range(len(points))
        for key, marker, how in (("ms", "o", "idle GPU"), ("ms_host_ahead", "^", "host ahead")):
            for layer, (color, name) in DYAD_LAYERS.items():
                timed = [(x, p[1][layer][key]) for x, p in zip(xs, points) if layer in p[1]]
                if timed:
                    ax.plot(*zip(*timed), marker, color=color, label=f"{name}, {how}")
            ax.plot(xs, [p[1][PEER][key] for p in points], marker, color="C3", label=f"torchtitan 0.3.0, {how}")
        ax.plot(xs, [p[1][PEER]["ms"] / GOAL for p in points], "_", color="k", markersize=22,
                label=f"goal: torchtitan / {GOAL} (idle GPU)")
        ax.set_xticks(list(xs), [p[0] for p in points], rotation=30)
        ax.set_title(f"MoE layer, {shape}, forward + backward, bf16")
        ax.set_ylabel("ms per step (median)")
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # the legend below the panels, off the points
    path = out / "moe_layer_runs.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def e2e_layouts(results: Path, names: str | tuple[str, ...]) -> dict:
    """The layouts of one run of E2E_RUNS, merged from its files."""
    merged = {}
    for name in (names,) if isinstance(names, str) else names:
        merged.update(load(results, name)["layouts"])
    return merged


def plot_e2e(results: Path, out: Path) -> Path:
    """One group of bars per run, one bar per layout that run measured (colour: the layout)."""
    runs = {label: e2e_layouts(results, names) for label, names in E2E_RUNS.items()}
    layouts = list(dict.fromkeys(layout for layouts in runs.values() for layout in layouts))
    colours = {layout: f"C{i}" for i, layout in enumerate(layouts)}
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.25 * sum(len(m) for m in runs.values()) + 0.2 * len(runs)))
    y, ticks = 0.0, []
    for label, measured in runs.items():
        first = y
        for layout in layouts:
            if layout not in measured:
                continue
            value = measured[layout].get("tokens_per_s", 0)
            ax.barh(y, value, height=0.9, color=colours[layout])
            ax.text(value, y, f" {value:,.0f}" if value else f" {layout}: {_why_no_bar(measured[layout])}",
                    va="center", fontsize=7)
            y += 1
        ticks.append(((first + y - 1) / 2, label))
        y += 0.8
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    most = max((m.get("tokens_per_s", 0) for measured in runs.values() for m in measured.values()), default=1)
    ax.set_xlim(0, 1.45 * most)  # room on the right for the legend
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
              fontsize=8, loc="upper right")
    ax.set_xlabel("tokens/s (median step)")
    ax.set_title("Two GPUs: ViT-L/14 + MoE LLM, compiled blocks, one GPU a pool against dp2")
    ax.invert_yaxis()
    fig.tight_layout()
    path = out / "e2e_two_gpus.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def e2e_setting(result: dict) -> str:
    """'(b) one GPU a pool, 3 rounds ahead' from one invocation's layout and its --set overrides
    (later ones win, as in the job's config); ', step not sent ahead' where router.send_ahead was off.
    Without an override the depth is 2, the default when these runs were made."""
    overrides = dict(item.split("=", 1) for item in result.get("config", []))
    (layout,) = result["layouts"]
    setting = f"{LAYOUT_NAMES.get(layout, layout)}, {overrides.get('boundary.prefetch_depth', '2')} rounds ahead"
    return setting + (", step not sent ahead" if overrides.get("router.send_ahead") == "false" else "")


def plot_e2e_560(results: Path, out: Path) -> Path:
    """Tokens/s and the LLM GPU's exposed wait of every 560-pixel invocation, one row per setting,
    one colour per machine start: a few points per setting read better than the table's rows."""
    rows: dict[str, list[tuple[str, dict]]] = {}
    for start, folder in E2E_560_STARTS.items():
        paths = sorted((results / folder).glob(E2E_560_FILES))
        if not paths:
            raise FileNotFoundError(f"no {E2E_560_FILES} under {results / folder} (see E2E_560_STARTS in bench/plots.py)")
        for path in paths:
            result = json.loads(path.read_text())
            rows.setdefault(e2e_setting(result), []).append((start, next(iter(result["layouts"].values()))))
    settings = sorted(rows)
    colours = {start: f"C{i}" for i, start in enumerate(E2E_560_STARTS)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.9 + 0.45 * len(settings)), sharey=True)
    for ax, key, scale, label in ((axes[0], "tokens_per_s", 1, "tokens/s (median step)"),
                                  (axes[1], "llm_wait_share", 100, "LLM GPU waiting for rows, % of the step")):
        for y, setting in enumerate(settings):
            for start, measured in rows[setting]:
                ax.plot(measured[key] * scale, y, "o", color=colours[start], alpha=0.8)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[1].axvline(3, color="k", linestyle=":", label="goal: 3 %")
    axes[0].set_yticks(range(len(settings)), settings, fontsize=8)
    axes[0].invert_yaxis()
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=c) for c in colours.values()]
    axes[0].legend(handles, [f"H200 pair, {start}" for start in colours], fontsize=8, loc="upper right")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("Two H200s: ViT-L/14 at 560 px + MoE LLM, compiled blocks, 64 samples a step")
    fig.tight_layout()
    path = out / "e2e_560_two_gpus.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _why_no_bar(result: dict | None) -> str:
    if result is None:
        return "not run"
    return "out of memory" if "OutOfMemoryError" in result.get("error", "") else "failed"


def main() -> None:
    docs_results = Path(__file__).resolve().parent.parent / "docs" / "results"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=docs_results, help="where the result files are")
    parser.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default: --results)")
    args = parser.parse_args()
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    for path in (plot_moe_runs(args.results, out), plot_e2e(args.results, out), plot_e2e_560(args.results, out)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
