"""The timeouts and the heap size read from the environment: a value that is not a number of
seconds (bytes) is a clear InvalidArgumentError naming the variable (the value), never a
ValueError or a silent default."""

import pytest

from rocmoe import errors
from rocmoe.runtime import first_call_timeout_from_env, timeout_from_env


@pytest.mark.parametrize("text", ["0", "-1", "soon", "nan", "inf", "1e999"])
def test_a_timeout_must_be_a_positive_finite_number(monkeypatch, text):
    monkeypatch.setenv("ROCMOE_TIMEOUT_S", text)
    with pytest.raises(errors.InvalidArgumentError, match="ROCMOE_TIMEOUT_S"):
        timeout_from_env()


def test_the_first_call_timeout_may_be_zero_but_not_negative(monkeypatch):
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "0")
    assert first_call_timeout_from_env() == 0.0
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "-5")
    with pytest.raises(errors.InvalidArgumentError, match="ROCMOE_FIRST_CALL_TIMEOUT_S"):
        first_call_timeout_from_env()


def test_the_first_call_timeout_may_not_be_infinite(monkeypatch):
    monkeypatch.setenv("ROCMOE_FIRST_CALL_TIMEOUT_S", "inf")
    with pytest.raises(errors.InvalidArgumentError, match="finite"):
        first_call_timeout_from_env()


@pytest.mark.parametrize("value", [-1, 0, float("inf"), "soon"])
def test_the_training_group_refuses_a_timeout_argument_that_bounds_nothing(value):
    from rocmoe.train.group import ProcessGroup
    with pytest.raises(errors.InvalidArgumentError, match="ProcessGroup timeout_s"):
        ProcessGroup(None, timeout_s=value)


def test_unset_timeouts_take_their_defaults(monkeypatch):
    monkeypatch.delenv("ROCMOE_TIMEOUT_S", raising=False)
    monkeypatch.delenv("ROCMOE_FIRST_CALL_TIMEOUT_S", raising=False)
    assert (timeout_from_env(), first_call_timeout_from_env()) == (60.0, 300.0)


@pytest.mark.parametrize("text, want", [("12.5", 12.5), ("", 60.0)])
def test_the_training_group_takes_the_timeout_the_runtime_takes(monkeypatch, text, want):
    from rocmoe.train.group import ProcessGroup
    monkeypatch.setenv("ROCMOE_TIMEOUT_S", text)
    assert ProcessGroup(None).timeout_s == want == timeout_from_env()


@pytest.mark.parametrize("text", ["0", "soon", "inf"])
def test_the_training_group_refuses_the_timeouts_the_runtime_refuses(monkeypatch, text):
    from rocmoe.train.group import ProcessGroup
    monkeypatch.setenv("ROCMOE_TIMEOUT_S", text)
    with pytest.raises(errors.InvalidArgumentError, match="ROCMOE_TIMEOUT_S"):
        ProcessGroup(None)


def test_the_environment_is_read_without_loading_librocmoe():
    # the training loop's process group and `rocmoe info` read the timeouts and the heap
    # size from rocmoe.env, which must not load the native library (a single-GPU run or a
    # CPU tool may not have it built)
    import subprocess
    import sys
    code = ("import sys, rocmoe.env as e, rocmoe.train.group; "
            "e.heap_size_from_env(); e.timeout_from_env(); e.first_call_timeout_from_env(); "
            "sys.exit(1 if 'rocmoe._native' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("text, want", [("512M", 512 << 20), ("1.5k", 1536), ("64KiB", 65536),
                                        ("4096", 4096), ("2G", 2 << 30)])
def test_the_heap_size_takes_bytes_or_a_binary_suffix(monkeypatch, text, want):
    from rocmoe.env import heap_size_from_env
    monkeypatch.setenv("ROCMOE_HEAP_SIZE", text)
    assert heap_size_from_env() == want


def test_a_heap_size_that_is_not_a_size_names_the_variable_and_value(monkeypatch):
    from rocmoe.env import heap_size_from_env
    monkeypatch.setenv("ROCMOE_HEAP_SIZE", "lots")
    with pytest.raises(errors.InvalidArgumentError, match="ROCMOE_HEAP_SIZE 'lots'"):
        heap_size_from_env()


def test_a_size_list_option_rejects_zero_and_names_the_option():
    from rocmoe.env import parse_sizes
    assert parse_sizes("1K, 64K,1M") == [1 << 10, 64 << 10, 1 << 20]
    with pytest.raises(errors.InvalidArgumentError, match="--sizes '1K,0'"):
        parse_sizes("1K,0")
