"""runtime/settings.py: the device's settings, their defaults from the environment, the pool's bound."""

from __future__ import annotations

import pytest

from torch_wgpu_lora.runtime.settings import (GEMMS_ENV, INPUT_GRAD_DIGITS_ENV, POOL_ENV, SHADER_CHECKS_ENV,
                                              SUBGROUPS_ENV, Settings, default_pool_bytes, settings_from_env)

from .helpers import run_python

GIB = 1 << 30


@pytest.fixture
def clean_env(monkeypatch):
    for name in (SHADER_CHECKS_ENV, SUBGROUPS_ENV, POOL_ENV, GEMMS_ENV, INPUT_GRAD_DIGITS_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_without_variables(clean_env):
    assert settings_from_env(24 * GIB) == Settings("bounds", True, 384 << 20)


def test_the_pool_bound_scales_with_the_device_memory():
    assert default_pool_bytes(24 * GIB) == 384 << 20  # a 24 GiB CPU adapter (lavapipe on a 24 GiB machine)
    assert default_pool_bytes(8 * GIB) == 128 << 20
    assert default_pool_bytes(141 * GIB) == 141 * GIB // 64  # an H200: 2.2 GiB
    assert default_pool_bytes(None) == GIB  # a GPU whose memory the implementation does not report


def test_variables_give_the_defaults(clean_env):
    clean_env.setenv(SHADER_CHECKS_ENV, "full")
    clean_env.setenv(SUBGROUPS_ENV, "0")
    clean_env.setenv(POOL_ENV, "256")
    clean_env.setenv(GEMMS_ENV, "general")
    clean_env.setenv(INPUT_GRAD_DIGITS_ENV, "2")
    assert settings_from_env(24 * GIB) == Settings("full", False, 256 << 20, "general", 2)
    clean_env.setenv(POOL_ENV, "0")  # keep no freed buffer
    assert settings_from_env(None).pool_bytes == 0


@pytest.mark.parametrize("name, value, said", [
    (SHADER_CHECKS_ENV, "bogus", f"{SHADER_CHECKS_ENV} must be one of full, bounds, none, got 'bogus'"),
    (SUBGROUPS_ENV, "yes", f"{SUBGROUPS_ENV} must be 1 (use subgroups where the adapter has them) or 0, got 'yes'"),
    (POOL_ENV, "1.5G", f"{POOL_ENV} must be a whole number of MiB >= 0, got '1.5G'"),
    (POOL_ENV, "-3", f"{POOL_ENV} must be a whole number of MiB >= 0, got '-3'"),
    (GEMMS_ENV, "fast", f"{GEMMS_ENV} must be one of measured, general, matrix_units, got 'fast'"),
    (INPUT_GRAD_DIGITS_ENV, "1", f"{INPUT_GRAD_DIGITS_ENV} must be one of 2, 3, 4, got '1'"),
    (INPUT_GRAD_DIGITS_ENV, "four", f"{INPUT_GRAD_DIGITS_ENV} must be one of 2, 3, 4, got 'four'"),
])
def test_a_bad_variable_is_one_clear_error_naming_it(clean_env, name, value, said):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError) as err:
        settings_from_env(GIB)
    assert str(err.value) == said


def test_a_bad_variable_stops_the_device_before_anything_runs():
    done = run_python("from torch_wgpu_lora.runtime import get_device; get_device()", {SHADER_CHECKS_ENV: "bogus"})
    assert done.returncode != 0
    assert f"ValueError: {SHADER_CHECKS_ENV} must be one of full, bounds, none, got 'bogus'" in done.stderr


@pytest.mark.parametrize("digits", [1, 5, True, 4.0])
def test_input_grad_digits_outside_two_to_four_are_refused(digits):
    with pytest.raises(ValueError, match="input_grad_digits must be one of 2, 3, 4"):
        Settings(input_grad_digits=digits)
