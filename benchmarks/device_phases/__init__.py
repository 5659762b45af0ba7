"""The device check's phases (benchmarks/device_check.py runs them and says what each measures), one module a concern:

- `measure.py`: the JSON line a figure is, the time budget, timing a jitted call and the profiler's top kernels.
- `shapes.py`: the model shapes the phases draw and the datasheet peaks MFU is taken over.
- `env.py`, `parity.py`, `attention.py`: the phases that run without the 8B model, each in its own worker.
- `model.py`: train, long, sample and agree, sharing one worker and one model.

Each imports `tinkerflow` inside its functions only, after the driver has made the package importable.
"""
