"""The soak of benchmarks/soak_attacks.py, short: adversarial clients (groups that can never fit,
disconnects, slow readers, oversized and chunked bodies, keyless /tokenize, bad numbers and
grammars, prompts too long, forged chat roles) beside normal clients against one real server.
Every normal request equals its solo run, every attack gets its expected answer in time, and
nothing is left held afterwards."""

import importlib.util
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_attacks.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_attacks", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_attacks_beside_normal_traffic_harm_no_normal_request(soak, stories_path):
    result = soak.run(stories_path, seconds=15, num_blocks=96, num_normal=3, num_attack=5, seed=1)
    assert not result["mismatches"], result["mismatches"][:3]
    assert not result["normal_errors"], result["normal_errors"][:3]
    assert not result["unexpected"], result["unexpected"][:5]
    assert result["normal_requests"] > 10
    assert len(result["attacks"]) >= 10  # most kinds of attack ran
    assert result["after"]["used"] == 0 and result["after"]["num_running"] == result["after"]["num_waiting"] == 0
    assert soak.passed(result)
