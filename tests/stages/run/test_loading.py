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
