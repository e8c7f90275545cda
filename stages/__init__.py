"""What the pipeline does.

    stages/            the five stages, each a plain `run(config, run)`:
                       train, import_model, qat, quantize, report (a package: its Markdown
                       and plots)
    stages/runtimes/   one module per inference runtime (pytorch, onnxruntime, openvino) behind one
                       registry of variants, the context a stage hands them (context), and the
                       file formats they write (onnx_export, graph_file)
    stages/shared/     the machinery they share: the run folder, data, models, precision, the
                       latency harness, statistics, the configuration search

Imports run one way: a stage imports runtimes and shared tools; a runtime imports shared tools;
shared tools import no stage and no runtime.
"""
