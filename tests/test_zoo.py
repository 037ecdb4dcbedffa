"""Pretrained weights: `--pretrained zoo[:TAG]` takes the zoo's own weights from this machine's cache (torch.hub's
checkpoint folder for torchvision, the Hugging Face cache for timm), never downloading; a `.safetensors` file loads
as a `.pth` does; `--normalize pretrained` is the chosen weights' own mean/std. The caches here are written by the
test, in the layout each zoo writes them."""

from __future__ import annotations

import pytest
import torch

from fastpipe.errors import ConfigError
from fastpipe.options import IMAGENET_MEAN_STD, normalize_text
from fastpipe.train.models import build_model, pretrained_normalization


def _same_but_head(model, state, head: str) -> None:
    own = model.state_dict()
    loaded = [k for k in state if not k.startswith(head)]
    assert loaded and all(torch.equal(own[k], state[k]) for k in loaded)
    assert own[f"{head}.weight"].shape[0] == 3  # the data set's classes, not the zoo's 1000


def test_torchvision_weights_come_from_torch_hubs_cache(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(ConfigError, match=r"not in this machine's cache .*resnet18-f37072fd\.pth.*weights="):
        build_model("resnet18", 3, 32, pretrained="zoo")
    state = torchvision.models.resnet18(num_classes=1000).state_dict()  # as torchvision would have saved them
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(state, tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth")
    _same_but_head(build_model("resnet18", 3, 32, pretrained="zoo"), state, "fc")
    _same_but_head(build_model("resnet18", 3, 32, pretrained="zoo:IMAGENET1K_V1"), state, "fc")
    with pytest.raises(ConfigError, match="IMAGENET1K_V1"):
        build_model("resnet18", 3, 32, pretrained="zoo:IMAGENET9K")
    assert pretrained_normalization("resnet18", "zoo") == normalize_text(*IMAGENET_MEAN_STD)


def test_timm_weights_come_from_the_hugging_face_cache(tmp_path, monkeypatch):
    timm = pytest.importorskip("timm")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    from safetensors.torch import save_file

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"timm/resnet10t.c3_in1k are not in this machine's Hugging Face cache"):
        build_model("timm:resnet10t.c3_in1k", 3, 32, pretrained="zoo")
    state = timm.create_model("resnet10t", pretrained=False).state_dict()
    repo = tmp_path / "hf" / "models--timm--resnet10t.c3_in1k"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    save_file(state, str(repo / "snapshots" / "0123abc" / "model.safetensors"))
    _same_but_head(build_model("timm:resnet10t.c3_in1k", 3, 32, pretrained="zoo"), state, "fc")
    _same_but_head(build_model("timm:resnet10t", 3, 32, pretrained="zoo"), state, "fc")  # timm's default tag


def test_pretrained_normalisation_is_the_weights_own(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    from fastpipe.train import zoo

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert normalize_text(*zoo.mean_std("timm:vit_base_patch16_224.augreg_in21k", "zoo")) == \
        "0.5,0.5,0.5:0.5,0.5,0.5"  # timm's ViT weights: not ImageNet's mean/std
    assert normalize_text(*zoo.mean_std("timm:resnet10t.c3_in1k", "zoo")) == normalize_text(*IMAGENET_MEAN_STD)
    with pytest.raises(ConfigError, match="not in this machine's Hugging Face cache"):  # said before any run starts
        pretrained_normalization("timm:resnet10t.c3_in1k", "zoo")


def test_a_safetensors_file_loads_as_a_pth_does(tmp_path):
    import torchvision
    from safetensors.torch import save_file

    state = torchvision.models.resnet18(num_classes=7).state_dict()
    save_file(state, str(tmp_path / "w.safetensors"))
    _same_but_head(build_model("resnet18", 3, 32, pretrained=str(tmp_path / "w.safetensors")), state, "fc")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ConfigError, match="not a weights file that can be loaded safely"):
        build_model("resnet18", 3, 32, pretrained=str(tmp_path / "bad.safetensors"))


def test_unknown_tags_and_normalising_as_no_weights_are_one_line():
    pytest.importorskip("timm")
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import resolve

    with pytest.raises(ConfigError, match=r"unknown pretrained tag .*timm:resnet10t\.c3_in1k"):
        build_model("timm:resnet10t.nonesuch", 3, 32)
    cfg = TrainConfig(data="x", normalize="pretrained", device="cpu")
    with pytest.raises(ConfigError, match="--normalize pretrained: there are no pretrained weights"):
        resolve(cfg, torch.device("cpu"))


def _timm_cache(root, hub_id: str, state) -> None:
    """The Hugging Face cache's layout for one repository's model.safetensors, as timm's download leaves it."""
    from safetensors.torch import save_file

    repo = root / f"models--{hub_id.replace('/', '--')}"
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    save_file(state, str(repo / "snapshots" / "0123abc" / "model.safetensors"))


def test_a_vits_zoo_weights_are_adapted_to_the_image_size(tmp_path, monkeypatch):
    """timm's own loader takes the zoo's weights: a ViT trained at 160 px keeps its position embedding at 64 px,
    resampled, not dropped and left random."""
    timm = pytest.importorskip("timm")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    state = timm.create_model("test_vit", pretrained=False).state_dict()
    _timm_cache(tmp_path / "hf", "timm/test_vit.r160_in1k", state)
    model = build_model("timm:test_vit.r160_in1k", 3, 64, pretrained="zoo")
    assert model.pos_embed.shape[1] == 1 + (64 // 16) ** 2
    assert torch.equal(model.pos_embed[0, 0], state["pos_embed"][0, 0])  # the class token's, kept
    assert torch.equal(model.blocks[0].attn.qkv.weight, state["blocks.0.attn.qkv.weight"])
    assert model.get_classifier().out_features == 3


def test_a_bad_tag_is_one_line_wherever_it_is_given(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import resolve

    for model, pretrained in (("timm:resnet10t", "zoo:nonesuch"), ("timm:resnet10t.c3_in1k", "zoo:a1_in1k")):
        with pytest.raises(ConfigError, match="resnet10t"):
            resolve(TrainConfig(data="x", model=model, pretrained=pretrained, device="cpu"), torch.device("cpu"))


def test_a_run_from_the_zoos_weights_records_them_and_their_normalisation(converted, tmp_path, monkeypatch):
    import torchvision

    from fastpipe.train.config import TrainConfig
    from fastpipe.train.session import train

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "torch/hub/checkpoints/resnet18-f37072fd.pth")
    run = train(TrainConfig(data=str(converted), out=str(tmp_path / "run"), model="resnet18", pretrained="zoo",
                            epochs=1, batch_size=8, image_size=32, workers=0, device="cpu"))
    card = torch.load(run / "best.pt", weights_only=True)["inference"]
    assert (card["zoo"], card["weights"]) == ("torchvision", "ResNet18_Weights.IMAGENET1K_V1")
    assert (tuple(card["mean"]), tuple(card["std"])) == IMAGENET_MEAN_STD
