import pytest
import torch

from stages.models import build_model, known_models


@pytest.mark.parametrize("name", ["smallcnn", "resnet18", "mobilenet_v3_small"])
def test_models_take_grey_images_and_give_one_logit_per_class(name):
    model = build_model(name, num_classes=10, in_channels=1).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'resnet7'.*smallcnn.*resnet18"):
        build_model("resnet7", 10, 1)
    assert "smallcnn" in known_models() and "resnet18" in known_models()
