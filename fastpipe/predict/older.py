"""The model card of a run trained before checkpoints carried one: rebuilt from the run's config.json (model,
classes, image size, normalisation) and its data set's dataset.json (the conversion settings), which must still be
where the run read it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from fastpipe.errors import FastpipeError
from fastpipe.loaders.config import LoaderConfig
from fastpipe.train import modelcard
from fastpipe.train.config import image_size_for_epoch
from fastpipe.train.runs import RunError
from fastpipe.util import read_json


def card_of_older_run(run_dir: Path) -> dict:
    config_file = Path(run_dir) / "config.json"
    try:
        config = read_json(config_file)
        train, data, norm = config["train"], config["data"], config["normalization"]
        size = image_size_for_epoch(SimpleNamespace(**{"progressive": None, **train}), train["epochs"] - 1)
        root = data["root"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RunError(f"{run_dir}: its checkpoint has no model record and {config_file} cannot say how photos were "
                       f"prepared ({type(e).__name__}: {str(e)[:100]}); train the model again with this fastpipe") \
            from None
    from fastpipe.dataset.loading import load

    try:
        manifest = load(root)
    except FastpipeError as e:
        raise RunError(f"{run_dir} was trained before fastpipe recorded how to prepare photos with the weights, and "
                       f"its data set {root} cannot be read to find out ({str(e)[:150]}); make it reachable there, "
                       f"or resume the run for one more epoch with this fastpipe (--resume --epochs N+1)") from None
    val = LoaderConfig()
    return modelcard.make(train["model"], data["classes"], manifest.task, size, norm["mean"], norm["std"],
                          train.get("amp") or "off", modelcard.convert_settings(manifest.settings, manifest.foreign),
                          val.val_crop, val.cpu_decoder)
