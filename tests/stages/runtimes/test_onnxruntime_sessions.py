"""Every ONNX Runtime session the pipeline opens stops its threads spinning when a run returns:
otherwise they take the cores from whatever is timed next."""
import onnx
from onnx import TensorProto, helper

from stages.runtimes.onnx_export import INPUT_NAME, OUTPUT_NAME
from stages.runtimes.onnxruntime import ort_session


def test_sessions_stop_spinning_when_a_run_returns(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", [INPUT_NAME], [OUTPUT_NAME])], "relu",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    options = ort_session(path, threads=2).get_session_options()
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert options.intra_op_num_threads == 2
