"""Every kind of bad input is refused with a clear message on every rank (tests/python/bad_input_catalog.py
provokes them), and docs/bad-input.md shows exactly these messages."""
import pytest

from bad_input_catalog import CASES, PAGE, render, run


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    return run(str(tmp_path_factory.mktemp("bad-input")))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{area}: {what}" for area, what, _, _ in CASES])
def test_each_bad_input_is_refused_with_the_reason(messages, index):
    area, what, expected, _ = CASES[index]
    for rank, rank_messages in enumerate(messages):
        message = rank_messages[index]
        if area == "parameter server" and rank == 1 and message == "(rank 1 serves)":
            continue  # the server rank answers worker 0's bad requests
        assert message is not None, f"rank {rank}: {what} was accepted"
        assert expected in message, f"rank {rank}: {message}"


def test_the_docs_page_shows_what_the_code_says(messages):
    assert PAGE.exists(), "write it: python tests/python/bad_input_catalog.py"
    assert PAGE.read_text() == render(messages[0]), (
        "docs/bad-input.md is out of date: python tests/python/bad_input_catalog.py rewrites it")
