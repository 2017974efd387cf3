"""Program loaders for the ANE lane's worker process (`hetero.coreml.backends.ane_worker`, given as "ane_faults:NAME")
that stand in for Core ML's `CompiledMLModel.predict` misbehaving: each runs the real reference executor, except
that at the worker's Nth job (HETERO_TEST_FAULT_AT, default 3) the worker process really dies (SIGKILL to
itself; `dies_after`: just after answering it), hangs (sleeps an hour) or returns NaN outputs; `dies_loading`
dies at its Nth program load instead."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from hetero.coreml.backends.reference_executor import ReferenceExecutor

_JOBS = [0]


def _faulty(fault):
    def load(path, function=None):
        real = ReferenceExecutor(path, function)

        def run(inputs: dict) -> dict:
            _JOBS[0] += 1
            if _JOBS[0] == int(os.environ.get("HETERO_TEST_FAULT_AT", "3")):
                return fault(real, inputs)
            return real(inputs)

        return run

    return load


def _die(real, inputs):
    os.kill(os.getpid(), signal.SIGKILL)


def _hang(real, inputs):
    time.sleep(3600)


def _die_after(real, inputs):
    """Answer this job, then die a moment later: between jobs, or while the engine sends the next one."""
    threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return real(inputs)


def _nan(real, inputs):
    return {name: np.full_like(a, np.nan) for name, a in real(inputs).items()}


dies, hangs, garbage, dies_after = _faulty(_die), _faulty(_hang), _faulty(_nan), _faulty(_die_after)

_LOADS = [0]


def dies_loading(path, function=None):
    """Core ML's compile or load killing the worker (an ANE compile failure, a memory-pressure kill): at the
    worker's Nth program load (HETERO_TEST_FAULT_AT) the process SIGKILLs itself."""
    _LOADS[0] += 1
    if _LOADS[0] == int(os.environ.get("HETERO_TEST_FAULT_AT", "3")):
        os.kill(os.getpid(), signal.SIGKILL)
    return ReferenceExecutor(path, function)


def temporaries(path, function=None):
    """A program that allocates as the reference executor does: each op's output afresh, temporaries of 1-6 MB
    that grow and shrink along the program (here 512 x 512 to 512 x 3072 fp32), none kept past the next op."""
    def run(inputs: dict) -> dict:
        a = inputs["x"]  # [512, 512]
        for width in (1024, 3072, 1536, 512):
            a = np.ones((a.shape[0], width), np.float32) * a[:, :1]
        return {"y": a}

    return run


def chatty(path, function=None):
    """Core ML's compiler and runtime writing to the process's stdout (file descriptor 1, as a C library does, and
    Python's print) while programs load and run."""
    os.write(1, f"compiling {os.path.basename(path)}\n".encode())
    real = ReferenceExecutor(path, function)

    def run(inputs: dict) -> dict:
        print("E5RT: predicting", flush=True)
        return real(inputs)

    return run
