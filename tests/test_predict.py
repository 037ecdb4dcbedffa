"""From a trained run to predictions on new photos: `fastpipe predict` gives, photo for photo, what the run's own
validation pass gives over the shards (the same pixels, so the same classes and probabilities), with every runtime
(the run's weights, ONNX, torch.export, the Python API); bad input is one line."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import COLORS, photo
from PIL import Image

from fastpipe.cli import main
from fastpipe.dataset.loading import load

TRAIN = dict(model="resnet18", batch_size=8, image_size=32, workers=0, device="cpu", epochs=2, optimizer="adamw",
             lr=1e-3, log_every=4)


def rotated(color, seed: int) -> bytes:
    """A JPEG stored sideways with EXIF orientation 6 (the camera was turned): the converter turns it upright."""
    im = Image.open(io.BytesIO(photo(color, (90, 120), seed=seed)))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=92, exif=exif)
    return buf.getvalue()


def odd_photos(root: Path, per_class: int = 14) -> Path:
    """Class folders whose photos come in every form users have: RGB, grey, CMYK JPEGs, RGBA PNGs, EXIF-rotated."""
    for k, name in enumerate(COLORS):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            seed, kind = k * 100 + i, i % 5
            if kind == 0:
                data, ext = rotated(COLORS[name], seed), "jpg"
            else:
                mode, fmt = (("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"))[kind - 1]
                data, ext = photo(COLORS[name], (120, 90), seed=seed, fmt=fmt, mode=mode), fmt.lower()
            (root / name / f"p{i:02d}.{ext}").write_bytes(data)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(photos, shards, run): a run trained on photos of every mode, with a val split."""
    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import train

    base = tmp_path_factory.mktemp("predict")
    src = odd_photos(base / "photos")
    shard(ShardConfig(src, base / "shards", short_side=48, val_fraction=0.3, workers=0))
    run = train(TrainConfig(data=str(base / "shards"), out=str(base / "run"), **TRAIN))
    return src, base / "shards", run


def val_sources(shards: Path) -> list[tuple[str, str]]:
    """(source path, class) of every val sample, as the shards record them."""
    from fastpipe import make_loader

    classes = load(shards).classes
    loader = make_loader(shards, split="val", batch_size=64, image_size=32, device="cpu", num_workers=0,
                         normalize=False, with_keys=True)
    return [(k.source, classes[y]) for _, labels, keys in loader for k, y in zip(keys, labels.tolist())]


def validation_pass(shards: Path, run: Path, backend: str = "torch") -> dict[str, list[float]]:
    """The run's validation over the shards, per source photo: the val loader training uses, best.pt's network."""
    from fastpipe import make_loader
    from fastpipe.options import normalize_text
    from fastpipe.train.models import build_model

    ck = torch.load(run / "best.pt", weights_only=True)
    card = ck["inference"]
    net = build_model(card["model"], len(card["classes"]), card["image_size"])
    net.load_state_dict(ck["model"])
    net.eval()
    loader = make_loader(shards, backend, split="val", batch_size=8, image_size=card["image_size"], device="cpu",
                         num_workers=0, normalize=normalize_text(card["mean"], card["std"]), with_keys=True)
    out = {}
    with torch.no_grad():
        for x, _, keys in loader:
            logits = net(x).float()
            probs = logits.sigmoid() if card["task"] == "multilabel" else logits.softmax(1)
            out.update({k.source: p for k, p in zip(keys, probs.tolist())})
    return out


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_predictions_on_the_val_photos_are_what_validation_gave_photo_for_photo(trained, tmp_path, capsys):
    src, shards, run = trained
    pairs = val_sources(shards)
    listed = src.parent / "val-labels.csv"  # paths relative to the list's folder
    listed.write_text("path,label\n" + "".join(f"photos/{p},{c}\n" for p, c in pairs))
    victim = tmp_path / "victim.txt"
    victim.write_text("not a picture")
    (tmp_path / "p.confusion.png").symlink_to(victim)  # planted under a picture's name: replaced, not written through
    assert main(["predict", str(run), str(listed), "--out", str(tmp_path / "p.jsonl"), "--workers", "2"]) == 0
    assert victim.read_text() == "not a picture" and not (tmp_path / "p.confusion.png").is_symlink()
    rows = {r["path"].removeprefix("photos/"): r for r in read_rows(tmp_path / "p.jsonl")}
    want = validation_pass(shards, run)
    assert set(rows) == set(want) and len(rows) == len(pairs)
    kinds = {Path(p).suffix for p in rows} | {Image.open(src / p).mode for p in rows}
    assert {".png", "L", "CMYK", "RGBA"} <= kinds  # the odd photos are among those compared
    for path, probs in want.items():
        got = dict(rows[path]["top_k"])
        assert rows[path]["predicted"] == max(got, key=got.get)
        classes = load(shards).classes
        assert max(abs(got[c] - p) for c, p in zip(classes, probs)) < 1e-5, path
    # the same accuracy as the run recorded for best.pt's epoch, to the last photo
    best = torch.load(run / "best.pt", weights_only=True)
    recorded = next(m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                    if m.get("kind") == "epoch" and m["epoch"] == best["epoch"])
    report = json.loads((tmp_path / "p.report.json").read_text())
    assert report["accuracy"] == recorded["val_acc"] == best["metric"]["val_acc"]  # named for new photos
    assert not any(k.startswith("val_") for k in report)
    assert (tmp_path / "p.confusion.png").stat().st_size > 3000 and (tmp_path / "p.classes.png").exists()
    assert f"accuracy {recorded['val_acc']:.4f} on {len(pairs)} labelled photos" in capsys.readouterr().out


def test_best_pt_is_the_epoch_of_the_best_validation_accuracy(trained):
    _, _, run = trained
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    accs = [(m["val_acc"], -m["epoch"]) for m in epochs if m.get("kind") == "epoch"]
    best = torch.load(run / "best.pt", weights_only=True)
    assert best["epoch"] == -max(accs)[1] and best["kind"] == "best"
    assert set(best) == {"kind", "epoch", "metric", "inference", "model", "normalize"}


def test_the_weights_load_into_plain_torchvision_in_three_lines(trained):
    """What the README shows: the checkpoint's weights and card, no fastpipe needed to use them."""
    import torchvision

    _, _, run = trained
    ck = torch.load(run / "best.pt", weights_only=True)
    model = torchvision.models.get_model(ck["inference"]["model"], num_classes=len(ck["inference"]["classes"]))
    model.load_state_dict(ck["model"])
    last = torch.load(run / "last.pt", weights_only=True)
    assert {"epoch", "model", "optimizer", "scheduler", "scaler", "inference", "normalize"} <= set(last)


def test_activation_checkpointing_keeps_torchvisions_weight_names():
    from fastpipe.train.models import build_model

    plain = build_model("resnet18", 3).state_dict()
    assert list(build_model("resnet18", 3, checkpoint_activations=True).state_dict()) == list(plain)


@pytest.mark.parametrize("suffix", [".onnx", ".pt2"])
def test_an_exported_model_gives_the_runs_answers_without_fastpipe(trained, tmp_path, suffix):
    src, shards, run = trained
    if suffix == ".onnx":
        pytest.importorskip("onnxruntime")
    out = tmp_path / f"leaves{suffix}"
    assert main(["export", str(run), str(out)]) == 0
    meta = json.loads((tmp_path / f"leaves{suffix}.json").read_text())
    assert meta["export"]["input"]["dtype"] == "uint8" and meta["inference"]["classes"] == list(load(shards).classes)
    assert main(["predict", str(run), str(src), "--out", str(tmp_path / "a.jsonl")]) == 0
    assert main(["predict", str(out), str(src), "--out", str(tmp_path / "b.jsonl")]) == 0
    a, b = read_rows(tmp_path / "a.jsonl"), read_rows(tmp_path / "b.jsonl")
    assert [r["predicted"] for r in a] == [r["predicted"] for r in b] and len(a) == 42
    assert max(abs(x - y) for ra, rb in zip(a, b) for (_, x), (_, y) in zip(ra["top_k"], rb["top_k"])) < 1e-4
    # a consumer without fastpipe: uint8 NCHW in, probabilities out, batch of one included
    x = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    if suffix == ".onnx":
        import onnxruntime as ort

        probs = ort.InferenceSession(str(out)).run(None, {"images": x.numpy()})[0]
    else:
        probs = torch.export.load(str(out)).module()(x).numpy()
    assert probs.shape == (1, 3) and abs(probs.sum() - 1) < 1e-5


def test_the_python_api_gives_the_clis_scores_and_the_loaders_input(trained, tmp_path):
    from fastpipe import Predictor, make_loader

    src, shards, run = trained
    p = Predictor(run, device="cpu")
    files = sorted(src.rglob("*.*"))[:6]
    assert main(["predict", str(run), *map(str, files), "--out", str(tmp_path / "c.jsonl"), "--workers", "0"]) == 0
    cli = read_rows(tmp_path / "c.jsonl")
    api = p.predict([str(f) for f in files[:3]] + [f.read_bytes() for f in files[3:]])
    assert [a.label for a in api] == [r["predicted"] for r in cli]
    assert all(abs(a.probability - r["probability"]) < 1e-6 for a, r in zip(api, cli))
    # transform(): the very tensor the validation loader hands the model for that photo
    path, _ = val_sources(shards)[0]
    card = p.card
    loader = make_loader(shards, split="val", batch_size=64, image_size=32, device="cpu", num_workers=0,
                         normalize=(card["mean"], card["std"]), with_keys=True)
    x, _, keys = next(iter(loader))
    row = [k.source for k in keys].index(path)
    assert torch.equal(p.transform(str(src / path)), x[row : row + 1])


def test_photos_without_labels_and_broken_ones_each_get_a_row(trained, tmp_path, capsys):
    src, _, run = trained
    new = tmp_path / "new"
    (new / "day1").mkdir(parents=True)
    for i, f in enumerate(sorted(src.rglob("*.jpg"))[:4]):
        shutil.copy(f, new / "day1" / f"{i}.jpg")
    (new / "broken.jpg").write_bytes(photo(COLORS["red"])[:300])
    (new / "notes.txt").write_text("not a photo")
    (new / "=HYPERLINK(1).jpg").write_bytes(photo(COLORS["red"]))  # a name a spreadsheet would run
    assert main(["predict", str(run), str(new), "--out", str(tmp_path / "n.csv")]) == 0
    rows = {r["path"]: r for r in read_rows(tmp_path / "n.csv")}
    assert set(rows) == {"broken.jpg", "notes.txt", "'=HYPERLINK(1).jpg", *(f"day1/{i}.jpg" for i in range(4))}
    assert rows["broken.jpg"]["status"] == "truncated" and rows["notes.txt"]["status"] == "not-an-image"
    assert all(rows[f"day1/{i}.jpg"]["predicted"] in COLORS for i in range(4))
    out = capsys.readouterr()
    assert "7 photos: 5 predicted, 2 could not be used" in out.out and "not the model's classes" in out.err
    assert not (tmp_path / "n.report.json").exists()  # no labels, no accuracy


def test_a_list_of_paths_alone_is_predicted_without_labels(trained, tmp_path):
    src, _, run = trained
    listed = src.parent / "paths.txt"
    listed.write_text("path\nphotos/red/p01.jpeg\nphotos/blue/p02.jpeg\nphotos/gone.jpg\n")
    assert main(["predict", str(run), str(listed), "--out", str(tmp_path / "l.csv")]) == 0
    rows = read_rows(tmp_path / "l.csv")
    assert [(r["path"], r["status"], r["label"]) for r in rows] == [
        ("photos/red/p01.jpeg", "ok", ""), ("photos/blue/p02.jpeg", "ok", ""), ("photos/gone.jpg", "missing", "")]


def test_last_weights_and_a_run_without_best_pt(trained, tmp_path, capsys):
    src, _, run = trained
    copy = tmp_path / "old-run"
    shutil.copytree(run, copy)
    (copy / "best.pt").unlink()
    assert main(["predict", str(copy), str(src / "red"), "--out", str(tmp_path / "o.csv")]) == 0
    assert "no best.pt" in capsys.readouterr().err and len(read_rows(tmp_path / "o.csv")) == 14


def test_a_multilabel_run_predicts_label_sets_at_its_own_thresholds(tmp_path, capsys):
    from test_multilabel import make_list

    from fastpipe.convert.driver import ShardConfig, shard
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import train

    (tmp_path / "src").mkdir()
    listed = make_list(tmp_path / "src", n=60)
    for i in range(0, 60, 3):  # every third photo in another form: rotated, grey, CMYK, RGBA (a PNG named .jpg)
        f = tmp_path / "src" / f"img_{i:03d}.jpg"
        im = Image.open(f)
        kind = (i // 3) % 4
        if kind == 0:
            exif = Image.Exif()
            exif[0x0112] = 6
            im.save(f, "JPEG", quality=92, exif=exif)
        else:
            im.convert(("L", "CMYK", "RGBA")[kind - 1]).save(f, "PNG" if kind == 3 else "JPEG")
    shard(ShardConfig(listed, tmp_path / "shards", short_side=48, val_fraction=0.25, workers=0))
    run = train(TrainConfig(data=str(tmp_path / "shards"), out=str(tmp_path / "run"), **{**TRAIN, "epochs": 1}))
    card = torch.load(run / "best.pt", weights_only=True)["inference"]
    assert len(card["thresholds"]) == 3 and all(0.05 <= t <= 0.95 for t in card["thresholds"])
    assert main(["predict", str(run), str(listed), "--out", str(tmp_path / "m.jsonl")]) == 0
    rows = read_rows(tmp_path / "m.jsonl")
    assert len(rows) == 60 and set(rows[0]["scores"]) == set(card["classes"])
    for r in rows:
        assert r["predicted"] == [c for c, t in zip(card["classes"], card["thresholds"]) if r["scores"][c] >= t]
    report = json.loads((tmp_path / "m.report.json").read_text())
    assert 0 <= report["map"] <= 1 and report["thresholds"] == card["thresholds"]
    assert report["photos"] == 60  # those labelled "none of them" (an empty set) are scored too
    assert any(r["label"] == "" for r in rows)
    # on the val photos, each class's score is what the run's validation pass gives
    want = validation_pass(tmp_path / "shards", run)
    got = {r["path"]: r["scores"] for r in rows}
    assert len(want) > 10 and set(want) <= set(got) and max(abs(got[p][c] - s) for p, ss in want.items()
                                   for c, s in zip(card["classes"], ss)) < 1e-5
    # last.pt takes its epoch's thresholds from metrics.jsonl: edited to nonsense, predict says it uses 0.5
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        if "per_class_threshold" in r:
            r["per_class_threshold"] = [float("nan"), 7.0, "x"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    assert main(["predict", str(run), str(listed), "--weights", "last", "--out", str(tmp_path / "l.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl: its model record's thresholds is" in err and "using 0.5 for every class" in err, err


def _edited(run: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "edited"
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run, copy)
    ck = torch.load(copy / "best.pt", weights_only=True)
    change(ck)
    torch.save(ck, copy / "best.pt")
    return copy


def test_a_run_validated_with_dali_predicts_with_torch_where_dali_is_missing(trained, tmp_path, monkeypatch, capsys):
    """DALI not installed here (its import fails, as on a machine without it): predict goes on with torch, says the
    pixels differ slightly and names the pip command for this torch's CUDA; the classes are still the run's."""
    from fastpipe.loaders.dali import install_command

    src, _, run = trained
    dali_run = _edited(run, tmp_path, lambda ck: ck["inference"].update(backend="dali"))
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    assert main(["predict", str(dali_run), str(src), "--out", str(tmp_path / "p.csv")]) == 0
    said = capsys.readouterr().err
    assert "validated with the dali backend, not installed here: predicting with torch" in said
    assert install_command() in said
    assert main(["predict", str(run), str(src), "--out", str(tmp_path / "t.csv")]) == 0
    assert [r["predicted"] for r in read_rows(tmp_path / "p.csv")] == \
        [r["predicted"] for r in read_rows(tmp_path / "t.csv")]


def test_the_dali_extra_named_is_the_one_for_the_cuda_of_torch():
    from fastpipe.loaders.dali import install_command

    assert install_command("12.4") == "pip install 'fastpipe[dali]'"
    assert install_command("13.0") == "pip install 'fastpipe[dali-cu13]'"
    assert "fastpipe[dali]" in install_command("11.8") and "fastpipe[dali-cu13]" in install_command("11.8")


@pytest.mark.parametrize("case,expected", [
    ("not-a-run", "not a fastpipe run folder"),
    ("nan-size", "image_size is 'nan'"),
    ("foreign", "is not a fastpipe checkpoint"),
    ("other-shapes", "its weights do not fit a resnet18 of 3 classes"),
    ("future", "reads version 1: upgrade fastpipe"),
    ("empty-src", "no files found to predict"),
    ("detection-model", "not a torchvision classification model"),
    ("no-cuda", "torch sees no CUDA device here"),
    ("credentials", "credentials in a URL are refused"),
])
def test_bad_input_is_one_line_and_exit_2(trained, tmp_path, capsys, case, expected):
    src, _, run = trained
    (tmp_path / "empty").mkdir()
    model, photos, extra = str(run), str(src), []
    if case == "not-a-run":
        model = str(tmp_path / "empty")
    elif case == "nan-size":
        model = str(_edited(run, tmp_path, lambda ck: ck["inference"].update(image_size=float("nan"))))
    elif case == "foreign":
        torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
        model = str(tmp_path / "foreign.pt")
    elif case == "other-shapes":
        model = str(_edited(run, tmp_path, lambda ck: ck["model"].update({"fc.bias": torch.zeros(5)})))
    elif case == "future":
        model = str(_edited(run, tmp_path, lambda ck: ck["inference"].update(version=99)))
    elif case == "empty-src":
        photos = str(tmp_path / "empty")
    elif case == "detection-model":  # would download a backbone's weights, or fail deep inside torchvision
        model = str(_edited(run, tmp_path, lambda ck: ck["inference"].update(model="fasterrcnn_resnet50_fpn")))
    elif case == "no-cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        extra = ["--device", "cuda"]
    else:
        photos = "s3://KEY:pw-hunter2@bucket/photos"
    assert main(["predict", model, photos, "--out", str(tmp_path / "x.csv"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err and "hunter2" not in err, err


def test_an_export_that_was_replaced_or_is_of_another_version_is_refused(trained, tmp_path, capsys):
    src, _, run = trained
    out = tmp_path / "m.pt2"
    assert main(["export", str(run), str(out)]) == 0
    meta_file = tmp_path / "m.pt2.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "export": {**meta["export"], "version": 7}}))
    assert main(["predict", str(out), str(src / "red"), "--out", str(tmp_path / "a.csv")]) == 2
    assert "export the model again with this fastpipe" in capsys.readouterr().err
    meta_file.write_text(json.dumps(meta))
    out.write_bytes(out.read_bytes() + b"\0")
    assert main(["predict", str(out), str(src / "red"), "--out", str(tmp_path / "a.csv")]) == 2
    assert "sha256 differs" in capsys.readouterr().err


def test_a_pt2_holding_a_pickle_is_refused_before_anything_in_it_runs(trained, tmp_path, capsys):
    """torch.export's loader unpickles some entries without restriction; a crafted file (with a JSON that names its
    sha256: whoever crafts one writes both) must not run code."""
    import pickle
    import zipfile

    _, src, run = trained[0], trained[0], trained[2]
    out = tmp_path / "m.pt2"
    assert main(["export", str(run), str(out)]) == 0
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    evil = tmp_path / "evil.pt2"
    with zipfile.ZipFile(out) as z, zipfile.ZipFile(evil, "w") as w:
        for info in z.infolist():
            data = z.read(info)
            if "/data/sample_inputs/" in info.filename:
                data = pickle.dumps(Payload())
            w.writestr(info, data)
    meta = json.loads((tmp_path / "m.pt2.json").read_text())
    meta["export"]["sha256"] = hashlib.sha256(evil.read_bytes()).hexdigest()
    (tmp_path / "evil.pt2.json").write_text(json.dumps(meta))
    assert main(["predict", str(evil), str(src / "red"), "--out", str(tmp_path / "e.csv"), "--trust-pt2"]) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and "which loading would run as code" in err and len(err.strip().splitlines()) == 1


def test_a_photo_over_the_pixel_limit_is_a_row_with_its_reason(trained, tmp_path):
    _, _, run = trained
    big = tmp_path / "big.jpg"
    data = bytearray(photo(COLORS["red"]))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") * 2  # the frame header claims 60000 x 60000
    big.write_bytes(bytes(data))
    assert main(["predict", str(run), str(big), "--out", str(tmp_path / "b.csv")]) == 0
    (row,) = read_rows(tmp_path / "b.csv")
    assert row["status"] == "too-large" and row["predicted"] == ""


@pytest.mark.dali
def test_dali_batches_give_what_a_dali_validation_pass_gives(trained, tmp_path):
    src, shards, run = trained
    listed = src.parent / "val-list.csv"
    listed.write_text("".join(f"photos/{p},{c}\n" for p, c in val_sources(shards)))
    assert main(["predict", str(run), str(listed), "--out", str(tmp_path / "d.jsonl"), "--backend", "dali"]) == 0
    rows = {r["path"].removeprefix("photos/"): dict(r["top_k"]) for r in read_rows(tmp_path / "d.jsonl")}
    classes = load(shards).classes
    want = validation_pass(shards, run, "dali")
    assert set(rows) == set(want)
    assert max(abs(rows[k][c] - p) for k, ps in want.items() for c, p in zip(classes, ps)) < 1e-5


# -- hostile models, records and arguments -------------------------------------------------------------------------
def _rezipped(src: Path, dst: Path, change=lambda name, data: data, add=(), compress=zipfile.ZIP_STORED) -> Path:
    """A copy of an archive with entries changed (change returns None to drop one), entries added, or compressed."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as w:
        for info in z.infolist():
            data = change(info.filename, z.read(info))
            if data is not None:
                w.writestr(info.filename, data, compress_type=compress)
        for name, data in add:
            w.writestr(name, data, compress_type=compress)
    return dst


def _sidecar_for(model: Path, meta: dict, **inference) -> None:
    """The export record beside `model`, naming its sha256 (whoever crafts a file writes both)."""
    meta = json.loads(json.dumps(meta))
    meta["export"]["sha256"] = hashlib.sha256(model.read_bytes()).hexdigest()
    meta["inference"].update(inference)
    Path(f"{model}.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """(m.pt2, its record, m.onnx or None) of the trained run."""
    out = tmp_path_factory.mktemp("exported")
    assert main(["export", str(trained[2]), str(out / "m.pt2")]) == 0
    onnx = None
    if importlib.util.find_spec("onnxruntime"):
        assert main(["export", str(trained[2]), str(out / "m.onnx")]) == 0
        onnx = out / "m.onnx"
    return out / "m.pt2", json.loads((out / "m.pt2.json").read_text()), onnx


def _graph_edit(edit):
    def change(name, data):
        if "/models/" not in name:
            return data
        doc = json.loads(data)
        edit(doc)
        return json.dumps(doc).encode()
    return change


def test_a_pt2_this_user_did_not_export_is_loaded_only_when_trusted(trained, exported, tmp_path, capsys):
    """A .pt2 runs code when torch loads it: one that this user's `fastpipe export` did not write (here the same
    program, its archive written anew) is refused, naming the .onnx export and --trust-pt2, which loads it."""
    from fastpipe import Predictor
    from fastpipe.train.runs import RunError

    src = trained[0]
    pt2, meta, _ = exported
    foreign = _rezipped(pt2, tmp_path / "foreign.pt2")
    _sidecar_for(foreign, meta)
    out = ["--out", str(tmp_path / "f.csv")]
    assert main(["predict", str(foreign), str(src / "red"), *out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not written by `fastpipe export` as this user" in err
    assert "load its .onnx export instead" in err and "--trust-pt2" in err
    assert main(["predict", str(foreign), str(src / "red"), *out, "--trust-pt2"]) == 0
    assert main(["predict", str(pt2), str(src / "red"), "--out", str(tmp_path / "own.csv")]) == 0  # this user's
    assert read_rows(tmp_path / "f.csv") == read_rows(tmp_path / "own.csv")
    with pytest.raises(RunError, match="trust_pt2=True"):
        Predictor(foreign)
    assert Predictor(foreign, trust_pt2=True).classes == meta["inference"]["classes"]


@pytest.mark.parametrize("case", ["expression", "power", "target", "string-input", "ranges", "guards", "case-variant",
                                  "extra", "compressed", "stub"])
def test_a_pt2_crafted_to_run_code_or_inflate_is_refused_even_when_trusted(trained, exported, tmp_path, capsys,
                                                                           case):
    """Beyond trust, a second line: torch.export evaluates shape expressions with sympy, resolves node targets from
    the torch module, builds guards from string inputs and runs them, finds entries ignoring case, reads extra/
    entries whole, and reads a zip otherwise than Python where the layout allows: each crafted file is one line,
    exit 2, with --trust-pt2 too."""
    src, marker = trained[0], tmp_path / "ran"
    pt2, meta, _ = exported
    root = zipfile.ZipFile(pt2).namelist()[0].split("/")[0]
    evil, kwargs = tmp_path / "evil.pt2", {}
    if case == "expression":
        code = f"N.__globals__['__builtins__']['__import__']('pathlib').Path({str(marker)!r}).write_text('ran') and "
        kwargs["change"] = lambda name, data: data.replace(b'"expr_str": "Symbol(', b'"expr_str": "' +
                                                           code.encode().replace(b"'", b"\\u0027") + b"Symbol(")
    elif case == "power":  # sympy would compute 10**10**10
        kwargs["change"] = lambda name, data: data.replace(b'"expr_str": "Symbol(',
                                                           b'"expr_str": "10**10**10 + Symbol(')
    elif case == "target":
        def first_target(doc):
            doc["graph_module"]["graph"]["nodes"][1]["target"] = "torch.os.system"
        kwargs["change"] = _graph_edit(first_target)
    elif case == "string-input":  # a string input becomes guard source that torch execs
        def string_input(doc):
            doc["graph_module"]["graph"]["inputs"].append({"as_string": "x' #\n)\nimport os\n"})
            doc["graph_module"]["signature"]["input_specs"].append(
                {"constant_input": {"name": "tag", "value": {"as_string": "x"}}})
        kwargs["change"] = _graph_edit(string_input)
    elif case == "ranges":  # torch counts up to a symbol's number
        kwargs["change"] = _graph_edit(lambda doc: doc["range_constraints"].update(
            u99999999999999={"min_val": 0, "max_val": 1}))
    elif case == "guards":
        kwargs["change"] = _graph_edit(lambda doc: doc.update(guards_code=[f"open({str(marker)!r}, 'w')"]))
    elif case == "case-variant":
        config = {"config": {"net.fc.bias": {"path_name": "evil_0", "is_param": True, "use_pickle": True}}}
        kwargs["add"] = [(f"{root}/Data/weights/model_weights_config.json", json.dumps(config)),
                         (f"{root}/data/weights/evil_0", b"\x80\x04K\x01.")]
    elif case == "extra":
        kwargs.update(add=[(f"{root}/extra/notes", b"\0" * (64 << 20))], compress=zipfile.ZIP_DEFLATED)
    elif case == "compressed":
        kwargs["compress"] = zipfile.ZIP_DEFLATED
    _rezipped(pt2, evil, **kwargs)
    if case == "stub":  # data before the archive: Python's zipfile and torch's reader would each read another one
        evil.write_bytes(b"\0" * 64 + pt2.read_bytes())
    _sidecar_for(evil, meta)
    assert main(["predict", str(evil), str(src / "red"), "--out", str(tmp_path / "e.csv"), "--trust-pt2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and str(evil) in err, err
    assert "use its .onnx export" in err or "not a zip archive as torch writes one" in err, err
    assert not marker.exists() and not (tmp_path / "e.csv").exists()


@pytest.mark.parametrize("kind", ["pt2", "onnx"])
@pytest.mark.parametrize("case", ["fewer-classes", "more-classes", "other-size"])
def test_an_exported_graph_that_does_not_fit_its_record_is_refused_before_the_first_photo(trained, exported, tmp_path,
                                                                                           capsys, kind, case):
    src = trained[0]
    pt2, meta, onnx = exported
    model = pt2 if kind == "pt2" else onnx
    if model is None:
        pytest.skip("onnxruntime is not installed")
    copy = tmp_path / model.name
    shutil.copy(model, copy)
    classes = meta["inference"]["classes"]
    change = {"fewer-classes": {"classes": classes[:2]}, "more-classes": {"classes": [*classes, "x", "y"]},
              "other-size": {"image_size": 16}}[case]
    _sidecar_for(copy, json.loads(Path(f"{model}.json").read_text()), **change)
    assert main(["predict", str(copy), str(src / "red"), "--out", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert ("does not take the input its record describes" if case == "other-size" else "classes") in err, err


def test_non_finite_weights_are_refused_and_a_non_finite_output_is_never_an_ok_row(trained, tmp_path, capsys):
    from fastpipe import Predictor
    from fastpipe.errors import DataError

    src, _, run = trained
    nan = _edited(run, tmp_path / "nan", lambda ck: ck["model"]["fc.weight"].fill_(float("nan")))
    assert main(["predict", str(nan), str(src / "red"), "--out", str(tmp_path / "n.csv")]) == 2
    assert "its weights hold NaN or infinity (fc.weight)" in capsys.readouterr().err
    # finite weights whose outputs overflow: the rows say so, the photos count as not predicted
    huge = _edited(run, tmp_path / "huge", lambda ck: ck["model"]["fc.weight"].fill_(3e38))
    assert main(["predict", str(huge), str(src / "red"), "--out", str(tmp_path / "h.csv")]) == 0
    rows = read_rows(tmp_path / "h.csv")
    assert rows and all(r["status"] == "non-finite" and r["predicted"] == "" for r in rows)
    assert "0 predicted, 14 could not be used" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"image 0 .*NaN or infinite"):
        Predictor(huge, device="cpu").predict([str(next((src / "red").iterdir()))])


def test_a_card_naming_a_far_larger_model_is_refused_without_building_it(trained, tmp_path, capsys):
    """A resnet18's weights under a card naming regnet_y_128gf: refused on the meta device (the real network would
    take gigabytes and many seconds to build before load_state_dict said no)."""
    src, _, run = trained
    big = _edited(run, tmp_path, lambda ck: ck["inference"].update(model="regnet_y_128gf"))
    assert main(["predict", str(big), str(src / "red"), "--out", str(tmp_path / "r.csv")]) == 2
    assert "do not fit a regnet_y_128gf of 3 classes (" in capsys.readouterr().err


def test_a_checkpoint_whose_entries_inflate_is_refused_before_loading(trained, tmp_path, capsys):
    src, _, run = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for damage in ("compressed", "stub"):
        if damage == "compressed":
            _rezipped(run / "best.pt", copy / "best.pt", compress=zipfile.ZIP_DEFLATED)
        else:  # data before it: another central directory could be read by torch than by Python's zipfile
            (copy / "best.pt").write_bytes(b"\0" * 64 + (run / "best.pt").read_bytes())
        assert main(["predict", str(copy), str(src / "red"), "--out", str(tmp_path / "c.csv")]) == 2
        err = capsys.readouterr().err
        assert "not a zip archive as torch writes one" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("where", ["sidecar", "older-config"])
def test_json_nested_too_deep_is_one_line(trained, exported, tmp_path, capsys, where):
    src, _, run = trained
    deep = "[" * 100_000 + "]" * 100_000
    if where == "sidecar":
        model = tmp_path / "m.pt2"
        shutil.copy(exported[0], model)
        (tmp_path / "m.pt2.json").write_text(deep)
    else:  # a run from before model cards: its config.json says how photos were prepared
        model = _edited(run, tmp_path, lambda ck: ck.pop("inference"))
        (model / "config.json").write_text(deep)
    assert main(["predict", str(model), str(src / "red"), "--out", str(tmp_path / "d.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nested more than 100 levels deep" in err, err


@pytest.mark.parametrize("arg,value", [("top_k", -1), ("top_k", 0), ("top_k", 2.5), ("top_k", float("nan")),
                                       ("top_k", True), ("batch_size", -1), ("batch_size", 0), ("batch_size", 1e9)])
def test_the_python_apis_arguments_are_checked_as_the_clis(trained, arg, value):
    from fastpipe import Predictor
    from fastpipe.errors import ConfigError

    src, _, run = trained
    with pytest.raises(ConfigError, match=re.escape(f"{arg} {value!r}: must be")):
        Predictor(run, device="cpu").predict([str(next((src / "red").iterdir()))], **{arg: value})


def test_thin_photos_and_every_pillow_mode_are_predicted(trained, tmp_path):
    """1x4000 and 4000x1 PNGs (the converter takes them) and PIL images in modes PNG cannot hold."""
    from fastpipe import Predictor

    src, _, run = trained
    p = Predictor(run, device="cpu")
    for size in ((1, 4000), (4000, 1)):
        Image.new("RGB", size, COLORS["red"]).save(tmp_path / f"{size[0]}x{size[1]}.png")
    assert main(["predict", str(run), str(tmp_path / "1x4000.png"), str(tmp_path / "4000x1.png"),
                 "--out", str(tmp_path / "t.csv")]) == 0
    assert [r["status"] for r in read_rows(tmp_path / "t.csv")] == ["ok", "ok"]
    assert len(p.predict([str(tmp_path / "1x4000.png"), str(tmp_path / "4000x1.png")])) == 2
    rgb = Image.open(next((src / "red").glob("*.jpeg"))).convert("RGB")
    want = p.predict(rgb).scores
    for mode in ("HSV", "La", "RGBa", "I", "CMYK"):
        got = p.predict(rgb.convert(mode) if mode != "I" else rgb.convert("L").convert("I"))
        assert got.label in COLORS
        if mode in ("HSV", "CMYK"):  # converted back to RGB by the converter's rule: the same scores within rounding
            assert max(abs(got.scores[c] - want[c]) for c in want) < 0.05


def test_an_export_never_writes_through_a_link_beside_its_file(trained, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("keep me")
    (tmp_path / ".m.tmp.pt2").symlink_to(other)
    assert main(["export", str(trained[2]), str(tmp_path / "m.pt2")]) == 0
    assert other.read_text() == "keep me" and zipfile.is_zipfile(tmp_path / "m.pt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.tmp.pt2", "m.prepare.py", "m.pt2", "m.pt2.json",
                                                          "other.txt"]


@pytest.mark.parametrize("model", ["timm:resnet10t", pytest.param("timm:test_vit", marks=pytest.mark.slow),
                                   pytest.param("timm:convnext_atto", marks=pytest.mark.slow)])
def test_a_timm_model_trains_predicts_and_exports_with_validations_answers(trained, tmp_path, model):
    """--model timm:NAME: the run's predictions on its val photos are its validation pass's, and the exported
    graphs give the run's answers, as for torchvision's models (a CNN, a ViT, a ConvNeXt)."""
    pytest.importorskip("timm")
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import train

    src, shards, _ = trained
    run = train(TrainConfig(data=str(shards), out=str(tmp_path / "run"), **{**TRAIN, "model": model, "epochs": 1}))
    card = torch.load(run / "best.pt", weights_only=True)["inference"]
    assert card["model"] == model and (card["zoo"], card["weights"]) == ("timm", "")
    assert main(["predict", str(run), str(src), "--out", str(tmp_path / "p.jsonl")]) == 0
    got = {r["path"]: dict(r["top_k"]) for r in read_rows(tmp_path / "p.jsonl")}
    want = validation_pass(shards, run)
    assert len(want) > 5 and max(abs(got[p][c] - s) for p, ss in want.items()
                                 for c, s in zip(card["classes"], ss) if c in got[p]) < 1e-5
    for suffix in (".pt2", ".onnx") if importlib.util.find_spec("onnxruntime") else (".pt2",):
        out = tmp_path / f"m{suffix}"
        assert main(["export", str(run), str(out)]) == 0
        assert main(["predict", str(out), str(src), "--out", str(tmp_path / f"e{suffix}.jsonl")]) == 0
        exported = read_rows(tmp_path / f"e{suffix}.jsonl")
        assert [r["predicted"] for r in exported] == [r["predicted"] for r in read_rows(tmp_path / "p.jsonl")]


def test_an_unknown_timm_model_is_one_line(trained, tmp_path, capsys):
    pytest.importorskip("timm")
    assert main(["train", str(trained[1]), "--model", "timm:resnet_nonesuch", "--out", str(tmp_path / "r"),
                 "--device", "cpu", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a name timm.list_models() gives" in err, err


def test_timm_weights_from_a_local_file_load_all_but_the_head(tmp_path):
    """--pretrained FILE for a timm model: its backbone from the file, the classifier sized for the data set."""
    pytest.importorskip("timm")
    from fastpipe.train.models import build_model

    source = build_model("timm:resnet10t", 7, 32)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    model = build_model("timm:resnet10t", 3, 32, pretrained=str(tmp_path / "w.pth"))
    assert torch.equal(model.state_dict()["conv1.0.weight"], source.state_dict()["conv1.0.weight"])
    assert model.state_dict()["fc.weight"].shape == (3, 512)


def bare_venv(root: Path, packages: tuple[str, ...]) -> Path:
    """A virtual environment holding only these installed packages (linked, with their bundled libraries): its
    python, run with -I, cannot import fastpipe, torch or OpenCV."""
    import subprocess

    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(root)],
                   check=True, timeout=120)
    site = next(root.glob("lib/python3*/site-packages"))
    for name in packages:
        where = Path(importlib.util.find_spec(name).origin).parent
        for d in (where, where.with_name(f"{name}.libs"), where.with_name(f"{name.lower()}.libs"),
                  where.with_name("pillow.libs") if name == "PIL" else where):
            if d.is_dir() and not (site / d.name).exists():
                (site / d.name).symlink_to(d)
    return root / "bin" / "python"


def test_the_exports_prepare_file_feeds_the_model_without_fastpipe(trained, exported, tmp_path):
    """MODEL.prepare.py, run in an environment with only ONNX Runtime, NumPy and Pillow, on photos of every kind the
    converter takes (EXIF-rotated, grey, CMYK, RGBA PNG, 16-bit PNG, one large enough to be decoded DCT-scaled): the
    model's input within a grey level of Predictor.inputs(), the same classes, probabilities within 1e-3."""
    import subprocess
    from operator import sub

    import numpy as np

    pytest.importorskip("onnxruntime")
    from fastpipe import Predictor

    src, onnx = trained[0], exported[2]
    script = onnx.with_name("m.prepare.py")
    python = bare_venv(tmp_path / "venv", ("numpy", "PIL", "onnxruntime"))
    deep = np.linspace(0, 65535, 90 * 120, dtype=np.uint16).reshape(90, 120)
    Image.fromarray(deep).save(tmp_path / "sixteen.png")  # a 16-bit PNG (mode I;16)
    (tmp_path / "large.jpg").write_bytes(photo(COLORS["red"], (800, 600), seed=7))
    photos = [str(p) for p in sorted(src.rglob("*.*"))[::3]] + [str(tmp_path / n) for n in ("sixteen.png",
                                                                                             "large.jpg")]
    probe = ("import importlib.util as u, runpy, sys, numpy; assert not any(map(u.find_spec, ('fastpipe', 'torch', "
             "'cv2'))); numpy.save(sys.argv[2], runpy.run_path(sys.argv[1])['prepare'](sys.argv[3:]))")
    runs = [subprocess.run([str(python), "-I", *argv], capture_output=True, text=True, timeout=300)
            for argv in ([str(script), *photos], ["-c", probe, str(script), str(tmp_path / "x.npy"), *photos])]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    rows = list(csv.DictReader(io.StringIO(runs[0].stdout)))
    p = Predictor(onnx)
    want = p.predict(photos)
    assert max(abs(float(r[c]) - w.scores[c]) for r, w in zip(rows, want) for c in p.classes) < 1e-3
    clear = [w for w in want if -sub(*sorted(w.scores.values())[-2:]) > 2e-3]  # not a tie within that tolerance
    assert len(rows) == len(photos) and len(clear) > 10
    assert [r["predicted"] for r, w in zip(rows, want) if w in clear] == [w.label for w in clear]
    ours = p.inputs(photos).cpu().numpy().astype(int)
    theirs = np.load(tmp_path / "x.npy").astype(int)
    assert theirs.shape == ours.shape and np.percentile(np.abs(theirs - ours), 99.9) <= 1
    # the predict guide's example, run as written in that environment
    guide = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "predict.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "leaves.prepare.py" in b)
    (tmp_path / "serve" / "new").mkdir(parents=True)
    shutil.copy(script, tmp_path / "serve" / "leaves.prepare.py")
    shutil.copy(onnx, tmp_path / "serve" / onnx.name)  # the model the file names, beside it
    shutil.copy(next(src.rglob("*.jpg")), tmp_path / "serve" / "new" / "leaf1.jpg")
    shutil.copy(next(src.rglob("*.png")), tmp_path / "serve" / "new" / "leaf2.png")
    done = subprocess.run([str(python), "-I", "-c", example + "\nprint(batch.shape, probs.shape)"],
                          cwd=tmp_path / "serve", capture_output=True, text=True, timeout=300)
    assert done.stdout.split("\n")[-2:] == [f"(2, 3, {ours.shape[-1]}, {ours.shape[-1]}) (1, 3)", ""], done.stderr


@pytest.mark.parametrize("mode", ["L", "LA", "La", "RGBA", "RGBa", "P", "PA", "CMYK", "I;16", "I", "F", "HSV", "1"])
def test_the_export_files_colour_conversion_is_the_converters(mode):
    """MODEL.prepare.py carries its own copy of convert/images.to_rgb (it imports nothing of fastpipe): both give
    the same pixels for every mode a photo can come in."""
    import numpy as np

    from fastpipe.convert.images import to_rgb
    from fastpipe.predict import standalone

    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, (24, 32, 4), dtype=np.uint8), "RGBA")
    if mode in ("I;16", "I", "F"):
        im = Image.fromarray(rng.integers(0, 65535, (24, 32)).astype({"I;16": np.uint16, "I": np.int32,
                                                                        "F": np.float32}[mode]))
        im = im if mode != "I;16" else Image.fromarray(np.asarray(im, np.uint16))
    elif mode == "P":
        im = base.convert("RGB").convert("P")
        im.info["transparency"] = 3
    else:
        im = base.convert(mode)
    assert np.array_equal(np.asarray(standalone._rgb(im)), np.asarray(to_rgb(im))), im.mode
