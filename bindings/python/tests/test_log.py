# The library's messages reach a Python callable and the logging module, at the level asked for;
# None turns them off; the diagnostic report names every part.
import logging

import numpy as np
import pytest

import gradacc


def one_step(scaler, value, overflow="skip_step"):
    with gradacc.Accumulator([(3, "f32")], overflow=overflow) as acc:
        acc.add(scaler, [np.ones(3, np.float32)], 1)
        acc.add(scaler, [np.array([1, value, 1], np.float32)], 1)
        acc.sync()
        return scaler.update(acc)


@pytest.fixture
def messages():
    got = []
    gradacc.set_log_callback(lambda level, message: got.append((level, message)), gradacc.LogLevel.DEBUG)
    yield got
    gradacc.set_log_callback(None)


def test_a_skipped_step_and_a_drop_reach_the_callback(messages):
    with gradacc.Scaler(init_scale=256.0, growth_interval=1) as scaler:
        assert one_step(scaler, np.inf)
        one_step(scaler, 2.0)
        one_step(scaler, np.nan, overflow="drop_microbatch")
    texts = [m for _, m in messages]
    assert (gradacc.LogLevel.INFO, "step 1 skipped: a gradient was not finite; loss scale 256 -> 128") in messages
    assert (gradacc.LogLevel.DEBUG, "step 2: loss scale grew 128 -> 256") in messages
    assert any("micro-batch 2 of the window dropped: tensor 0" in t for t in texts), texts


def test_none_turns_the_messages_off(messages):
    gradacc.set_log_callback(None)
    with gradacc.Scaler() as scaler:
        one_step(scaler, np.inf)
    assert messages == []


def test_log_to_logging_uses_the_logging_levels(caplog):
    caplog.set_level(logging.DEBUG, logger="gradacc")
    gradacc.log_to_logging(level=gradacc.LogLevel.INFO)
    try:
        with gradacc.Scaler(init_scale=64.0) as scaler:
            one_step(scaler, np.inf)
    finally:
        gradacc.set_log_callback(None)
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("gradacc", logging.INFO, "step 1 skipped: a gradient was not finite; loss scale 64 -> 32") in records


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError):
        gradacc.set_log_callback(print, 9)


def test_the_report_names_every_part():
    report = gradacc.diagnostics()
    assert report.startswith(f"gradacc {gradacc.version()} (")
    for part in ("SIMD path: ", "backends:", "  MPI: ", "  CUDA: ", "  NCCL: ", "libraries:", "GRADACC_LOG"):
        assert part in report, part
