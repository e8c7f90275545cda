import numpy as np
import torch

from stages.measure import evaluate
from stages.runtimes import onnxruntime, openvino


class RecordingSession:
    """An ONNX Runtime session's run, keeping the batch sizes it was given."""

    def __init__(self):
        self.batches = []

    def run(self, outputs, feed):
        (batch,) = feed.values()
        self.batches.append(len(batch))
        return [np.zeros((len(batch), 10), dtype=np.float32)]


def test_scoring_batches_hold_the_pixels_of_32_images_of_224x224():
    """A session keeps the memory of its largest batch: 256 images at 224x224 took the
    report's ONNX Runtime sessions to some 5 GB each. Small images keep batches of 256."""
    assert evaluate.scoring_batch_size((360, 3, 224, 224)) == 32
    assert evaluate.scoring_batch_size((360, 1, 32, 32)) == 256
    assert evaluate.scoring_batch_size((1, 3, 2048, 2048)) == 1
    session = RecordingSession()
    logits = onnxruntime.ort_predict(session, torch.zeros(70, 3, 224, 224))
    assert session.batches == [32, 32, 6] and logits.shape == (70, 10)
    dataset = torch.utils.data.TensorDataset(torch.zeros(40, 3, 224, 224),
                                             torch.zeros(40, dtype=torch.long))
    seen = []
    evaluate.predict_dataset(lambda images: seen.append(len(images)) or torch.zeros(
        len(images), 10), dataset)
    assert seen == [32, 8]


def test_an_openvino_request_scores_in_the_same_batches():
    class Request:
        def __init__(self):
            self.batches = []

        def infer(self, inputs, share_inputs):
            self.batches.append(len(inputs[0]))
            return [np.zeros((len(inputs[0]), 10), dtype=np.float32)]

    request = Request()

    class Compiled:
        def create_infer_request(self):
            return request

    predict, _ = openvino.runner(Compiled())
    assert predict(torch.zeros(33, 3, 224, 224)).shape == (33, 10)
    assert request.batches == [32, 1]
