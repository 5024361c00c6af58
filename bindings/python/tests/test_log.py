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


def skipped(messages):
    """The skipped-step messages among `messages` (others, such as the SIMD path chosen at the
    process's first kernel, depend on what ran before)."""
    return [m for _, m in messages if " skipped: " in m]


def test_none_turns_the_messages_off(messages):
    with gradacc.Scaler() as scaler:
        one_step(scaler, np.inf)
        assert len(skipped(messages)) == 1, messages  # on: the skipped step arrives
        gradacc.set_log_callback(None)
        one_step(scaler, np.inf)
    assert len(skipped(messages)) == 1, messages


def test_log_to_logging_uses_the_logging_levels(caplog):
    caplog.set_level(logging.DEBUG, logger="gradacc")

    def records():
        return [(r.name, r.levelno, r.getMessage()) for r in caplog.records]

    try:
        with gradacc.Scaler(init_scale=64.0, growth_interval=1) as scaler:
            gradacc.log_to_logging(level=gradacc.LogLevel.INFO)
            one_step(scaler, np.inf)
            one_step(scaler, 2.0)  # grows 32 -> 64: a DEBUG message, filtered out at INFO
            assert records() == [
                ("gradacc", logging.INFO, "step 1 skipped: a gradient was not finite; loss scale 64 -> 32")]
            gradacc.log_to_logging(level=gradacc.LogLevel.DEBUG)
            one_step(scaler, 2.0)
    finally:
        gradacc.set_log_callback(None)
    assert records()[1:] == [("gradacc", logging.DEBUG, "step 3: loss scale grew 64 -> 128")]


def test_an_unknown_level_is_refused_and_changes_nothing(messages):
    with pytest.raises(ValueError, match="9 is not a valid LogLevel"):
        gradacc.set_log_callback(print, 9)
    with gradacc.Scaler() as scaler:
        one_step(scaler, np.inf)
    assert len(skipped(messages)) == 1, "the earlier callback is no longer set"


def test_the_report_names_every_part():
    report = gradacc.diagnostics()
    assert report.startswith(f"gradacc {gradacc.version()} (")
    for part in ("SIMD path: ", "backends:", "  MPI: ", "  CUDA: ", "  NCCL: ", "libraries:", "GRADACC_LOG"):
        assert part in report, part
