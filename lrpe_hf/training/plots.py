"""A PNG of the training and evaluation loss curves from a Trainer's log history."""

from pathlib import Path


def plot_loss_curves(log_history: list[dict], path: Path, title: str = "") -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evaluation = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not evaluation:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for points, label in ((train, "train loss"), (evaluation, "eval loss")):
        if points:
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 30 else None, label=label
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
