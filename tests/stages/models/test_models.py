"""Models by name: built-ins, torchvision, timm, a user's own; sizes refused up front."""
import pytest
import torch

from stages.models.build import (
    build_model,
    check_model_fits,
    check_model_name,
    fully_connected_share,
    initialisation,
    known_models,
)
from stages.run.errors import PipelineError, UsageError

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["smallcnn", "mixer", "resnet18", "mobilenet_v3_small",
                                  "timm:test_resnet"])
def test_models_take_grey_images_and_give_one_logit_per_class(name):
    model = build_model(name, num_classes=10, in_channels=1).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name", ["mnasnet0_5", "efficientnet_b0"])
def test_a_head_scaled_for_1000_classes_starts_near_chance_and_passes_gradient(name):
    """torchvision scales these heads by their outputs: built for 10 classes they began at
    losses of 13.3 and 6.1. At PyTorch's default scale the first loss is near ln(10), and the
    layers below the head get a gradient from the first step (a zeroed head gives them none)."""
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=1).train()
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    assert float(head.weight.detach().std()) < 1.2 / (3 * head.in_features) ** 0.5
    images, labels = torch.randn(8, 1, 32, 32), torch.arange(8)
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    assert abs(loss.item() - torch.log(torch.tensor(10.0)).item()) < 0.3
    loss.backward()
    below = [p for p in model.parameters() if p.ndim == 4]  # the convolutions
    assert all(p.grad is not None for p in below) and float(below[-1].grad.abs().sum()) > 0


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_a_head_at_or_below_pytorchs_own_scale_keeps_its_initialisation(name):
    torch.manual_seed(0)
    head = [m for m in build_model(name, num_classes=10, in_channels=1).modules()
            if isinstance(m, torch.nn.Linear)][-1]
    torch.manual_seed(0)
    import torchvision

    original = [m for m in torchvision.models.get_model(name, weights=None, num_classes=10)
                .modules() if isinstance(m, torch.nn.Linear)][-1]
    assert torch.equal(head.weight, original.weight)


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_large", "efficientnet_b0",
                                  "mnasnet0_5"])
def test_each_residual_block_of_a_depthwise_family_starts_as_the_identity(name):
    """Their last BatchNorm's scale is zeroed (each block's output is its input, so the
    network starts shallow and learns fast enough for a range test to read); ResNets keep
    torchvision's BatchNorm scales of one."""
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=3).eval()
    seen = []
    for block in model.modules():
        if getattr(block, "use_res_connect", False) or getattr(block, "apply_residual", False):
            block.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    model(torch.randn(2, 3, 32, 32))
    assert len(seen) >= 6 and all(torch.equal(given, out) for given, out in seen)
    assert initialisation(name, 10, 3, 32).endswith(
        f"each of its {len(seen)} residual blocks zeroed (each starts as the identity)")
    resnet = build_model("resnet18", num_classes=10, in_channels=3)
    assert all(bool((m.weight == 1).all()) for m in resnet.modules()
               if isinstance(m, torch.nn.BatchNorm2d))
    assert initialisation("resnet18", 10, 3, 32) == "torchvision's"


@pytest.mark.parametrize("name, size, weights, work", [
    ("resnet18", 32, (0.0004, 0.0005), (0.0001, 0.0002)),  # fc's 5,120 of 11.2M weights
    ("resnet18", 224, (0.0004, 0.0005), (0.0, 0.00001)),
    ("smallcnn", 8, (0.026, 0.027), (0.001, 0.0011)),  # Linear(64, 10): 640 of 23,824
    ("mixer", 32, (1.0, 1.0), (1.0, 1.0)),  # Linear layers only, the patches cut by Unfold
])
def test_the_fully_connected_share_counts_weights_and_matrix_products(name, size, weights, work):
    model = build_model(name, 10, 1, size).eval()
    share = fully_connected_share(model, torch.zeros(1, 1, size, size))
    assert weights[0] <= share["weights"] <= weights[1], share
    assert work[0] <= share["work"] <= work[1], share


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'resnet7'.*smallcnn.*resnet18"):
        build_model("resnet7", 10, 1)
    with pytest.raises(ValueError, match="--model 'resnet7' is not one of: .*timm:NAME"):
        check_model_name("resnet7")
    with pytest.raises(ValueError, match="timm has no model 'nope'"):
        check_model_name("timm:nope")
    check_model_name("mypackage.models:factory")  # imported only when built
    assert "smallcnn" in known_models() and "resnet18" in known_models()


def test_a_users_factory_gets_the_keywords_it_declares(tmp_path, monkeypatch):
    (tmp_path / "usernets.py").write_text(
        "import torch.nn as nn\n"
        "def net(num_classes, image_size):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(image_size * image_size, num_classes))\n"
        "def not_a_module(num_classes):\n    return 'a string'\n"
        "def no_classes(in_channels):\n    return nn.Identity()\n")
    monkeypatch.chdir(tmp_path)
    model = build_model("usernets:net", num_classes=7, in_channels=1, image_size=8)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 7)
    with pytest.raises(PipelineError, match="returned str, not a torch.nn.Module"):
        build_model("usernets:not_a_module", 7, 1, 8)
    with pytest.raises(PipelineError, match="must take a num_classes keyword"):
        build_model("usernets:no_classes", 7, 1, 8)
    with pytest.raises(PipelineError, match="cannot import it .*'import missing_module' works"):
        build_model("missing_module:net", 7, 1, 8)


def test_a_users_factory_that_raises_or_imports_what_is_missing_is_named_as_such(
        tmp_path, monkeypatch):
    """A factory that forwards in_channels to a class without it had been reported as failing
    "at every size from 8 to 299" (after eleven more builds), and a module whose own import
    is missing as one to run from its folder."""
    (tmp_path / "forwarding_nets.py").write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Linear):\n    def __init__(self, num_classes):\n"
        "        super().__init__(4, num_classes)\n"
        "def forwards(num_classes, **options):\n    return Net(num_classes, **options)\n")
    (tmp_path / "needs_timm.py").write_text("import not_installed_here\ndef net(num_classes):"
                                            "\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match=r"^--model forwarding_nets:forwards: forwards\("
                                            r"num_classes=7, in_channels=1, image_size=8\) "
                                            r"raised TypeError: .*; fix the factory$"):
        check_model_fits("forwarding_nets:forwards", 7, 1, 8, 64, CPU)
    with pytest.raises(PipelineError, match=r"^--model needs_timm:net: needs_timm imports "
                                            r"'not_installed_here', which is not installed here"):
        build_model("needs_timm:net", 7, 1, 8)


@pytest.mark.parametrize("name, size, needle", [
    ("vit_b_16", 32, "it trains at --image-size 224"),
    ("alexnet", 32, "it trains at --image-size 64,"),
    ("inception_v3", 32, "it trains at --image-size 75,"),
])
def test_a_size_a_model_cannot_take_is_refused_with_the_sizes_it_can(name, size, needle):
    with pytest.raises(UsageError) as raised:
        check_model_fits(name, 10, 1, size, 64, CPU)
    assert f"--model {name} cannot train on {size}x{size} images" in str(raised.value)
    assert needle in str(raised.value)


def test_a_users_model_that_fails_at_every_size_is_not_blamed_on_the_size(tmp_path,
                                                                           monkeypatch):
    """A bug in the model's forward is the model's, whatever the image size."""
    (tmp_path / "buggy.py").write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes):\n"
        "        super().__init__()\n        self.fc = nn.Linear(4, num_classes)\n"
        "    def forward(self, x):\n        return self.fc(undefined_name)\n"
        "def net(num_classes):\n    return Net(num_classes)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError) as raised:
        check_model_fits("buggy:net", 10, 1, 32, 64, CPU)
    message = str(raised.value)
    assert message.startswith("--model buggy:net fails on a batch of 1-channel 32x32 images at "
                              "every size from 8 to 299 (NameError: name 'undefined_name'")
    assert "cannot train on" not in message and message.endswith("fix the model or choose another")


def test_a_users_model_that_reads_its_data_or_holds_a_module_level_tensor_is_accepted(
        tmp_path, monkeypatch):
    """The size check runs the forward on the meta device: a module's top-level tensor made
    under it stayed meta for the real model (its first step failed after the check passed),
    and a forward that reads its data (`if x.max() > 1`) cannot run there at all (it was
    refused as failing at every size)."""
    (tmp_path / "datanets.py").write_text(
        "import torch\nimport torch.nn as nn\n"
        "SCALE = torch.ones(1)\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes, reads):\n"
        "        super().__init__()\n        self.fc = nn.Linear(64, num_classes)\n"
        "        self.reads = reads\n"
        "    def forward(self, x):\n"
        "        if self.reads and x.max() > 1:\n            x = x / 255\n"
        "        return self.fc((x * SCALE).flatten(1))\n"
        "def scaled(num_classes):\n    return Net(num_classes, False)\n"
        "def reads(num_classes):\n    return Net(num_classes, True)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("datanets:scaled", "datanets:reads"):
        check_model_fits(name, 10, 1, 8, 64, CPU)
        assert build_model(name, 10, 1, 8)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(UsageError, match="fails on a batch of 1-channel 16x16 images at every "
                                         "size"):
        check_model_fits("datanets:reads", 10, 1, 16, 64, CPU)  # 256 inputs, not 64


def test_a_size_that_cannot_fit_in_memory_is_refused_with_what_fits():
    with pytest.raises(UsageError) as raised:
        check_model_fits("resnet18", 10, 1, 100_000, 64, CPU, dataset_bytes=1797 * 4 * 10**10)
    message = str(raised.value)
    assert message.startswith("--image-size 100000: training resnet18 at --batch-size 64 needs")
    largest = int(message.rsplit("about ", 1)[1])
    assert 64 <= largest < 5000
    check_model_fits("resnet18", 10, 1, min(largest, 224) // 2, 64, CPU)  # half of it fits


def test_googlenet_and_inception_train_without_auxiliary_outputs():
    model = build_model("googlenet", 10, 1).train()
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)
