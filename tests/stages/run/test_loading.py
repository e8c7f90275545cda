import pickle

import pytest

from stages.run import loading
from stages.run.errors import PipelineError


def test_load_checkpoint_refuses_code_in_a_pickle(tmp_path):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": Payload()}, f)
    with pytest.raises(PipelineError) as refused:
        loading.load_checkpoint(path)
    assert str(refused.value) == (f"{path} was refused: loading it would run code from the file; "
                                  "save the weights alone (torch.save(model.state_dict(), path)) "
                                  "and give that file")
    assert not marker.exists()


@pytest.mark.parametrize("content, says", [
    (b"root:x:0:0:root:/root:/bin/bash\n", "is not a PyTorch weights file (neither torch.save's "
                                            "zip archive nor a pickle)"),
    (b"", "is empty: it is not a weights file"),
    (b"PK\x03\x04" + b"\0" * 64, "cannot load"),
])
def test_a_file_that_is_not_weights_says_what_it_is_not(tmp_path, content, says):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(PipelineError) as refused:
        loading.load_checkpoint(path)
    assert str(path) in str(refused.value) and says in str(refused.value)


def test_a_torchscript_file_is_named_as_one_not_as_corrupt(tmp_path, recwarn):
    """torch.jit.save's file had read "cannot load ...: Cannot use ``weights_only=True`` with
    TorchScript archives ... the file is truncated or corrupt", beside torch's advice to call
    torch.jit.load."""
    import torch

    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.raises(PipelineError) as refused:
        loading.load_checkpoint(path)
    assert str(refused.value) == (
        f"{path} is a TorchScript file (torch.jit.save), a program rather than weights; save "
        "the weights alone (torch.save(model.state_dict(), path)) and give that file")
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]
