"""Reading llama-server's iterations from its debug log (``fairgate.harness.llamacpp_steps``): a real excerpt of
the engine's log, and logs written in its format from generated iterations."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.harness.llamacpp_steps import decode_step_ms, gpu_ms_by_task, read_engine_log

# llama-server 11434 (-lv 5, -np 4) serving two chat requests of 5 tokens sent 4 ms apart (the lines this reads,
# as it wrote them): task 0 is prefilled alone; task 2 arrived during that and is prefilled in the next
# iteration, beside task 0's first decode; then both decode.
EXCERPT = """\
0.00.094.541 I srv  update_slots: all slots are idle
0.02.022.245 I slot   operator(): id  3 | task 0 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 52
0.02.022.384 D srv        decode: n_batch (effective) = 2048, off = 0
0.02.064.092 D slot process_toke: id  3 | task 0 | n_gen = 1, n_remaining = 4, next token:   833 ' qs'
0.02.064.229 I slot   operator(): id  2 | task 2 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 52
0.02.064.267 D srv        decode: n_batch (effective) = 2048, off = 0
0.02.094.773 D slot process_toke: id  2 | task 2 | n_gen = 1, n_remaining = 4, next token:   750 ' hn'
0.02.094.851 D slot process_toke: id  3 | task 0 | n_gen = 2, n_remaining = 3, next token:   826 ' qa'
0.02.094.868 D srv        decode: n_batch (effective) = 2048, off = 0
0.02.100.202 D slot process_toke: id  2 | task 2 | n_gen = 2, n_remaining = 3, next token:   577 'oo'
0.02.100.223 D slot process_toke: id  3 | task 0 | n_gen = 3, n_remaining = 2, next token:   441 ' ^'
0.02.100.240 D srv        decode: n_batch (effective) = 2048, off = 0
0.02.105.299 D slot process_toke: id  2 | task 2 | n_gen = 3, n_remaining = 2, next token:   862 ' ua'
0.02.105.395 D slot process_toke: id  3 | task 0 | n_gen = 4, n_remaining = 1, next token:   848 ' su'
0.02.105.413 D srv        decode: n_batch (effective) = 2048, off = 0
0.02.110.436 D slot process_toke: id  2 | task 2 | n_gen = 4, n_remaining = 1, next token:   827 ' qe'
0.02.110.457 D slot process_toke: id  3 | task 0 | stopped by limit, n_gen = 5, n_predict = 5
0.02.110.458 D slot process_toke: id  3 | task 0 | n_gen = 5, n_remaining = 0, next token:   367 ' d'
0.02.110.480 I slot      release: id  3 | task 0 | stop processing: n_tokens = 56, truncated = 0
0.02.110.496 D srv        decode: n_batch (effective) = 2048, off = 0
0.02.115.112 D slot process_toke: id  2 | task 2 | stopped by limit, n_gen = 5, n_predict = 5
0.02.115.113 D slot process_toke: id  2 | task 2 | n_gen = 5, n_remaining = 0, next token:   625 'tr'
0.02.115.134 I slot      release: id  2 | task 2 | stop processing: n_tokens = 56, truncated = 0
0.02.115.140 I srv  update_slots: all slots are idle
"""


def test_the_engines_iterations_and_who_was_in_each(tmp_path: Path) -> None:
    (tmp_path / "server.log").write_text(EXCERPT)
    log = read_engine_log(tmp_path / "server.log")
    assert [round(it.ms, 3) for it in log.iterations] == [41.883, 30.601, 5.372, 5.173, 5.083, 4.644]
    assert [(it.decoded, it.prefilled) for it in log.iterations] == [
        ([], {0: 52}), ([0], {2: 52}), ([2, 0], {}), ([2, 0], {}), ([2, 0], {}), ([2], {}),
    ]  # fmt: skip
    assert log.n_predict == {0: 5, 2: 5}
    assert decode_step_ms(log.iterations) == pytest.approx({2: 5.173, 1: 4.644})


def test_a_prefill_iteration_gives_the_decoding_sequences_a_pure_decode_step_and_the_prompt_the_rest(
    tmp_path: Path,
) -> None:
    (tmp_path / "server.log").write_text(EXCERPT)
    used = gpu_ms_by_task(read_engine_log(tmp_path / "server.log"))
    # Task 2's prefill iteration (30.601 ms) beside task 0's decode: task 0 gets d(1) = 4.644 ms of it.
    both = (5.372 + 5.173 + 5.083) / 2
    assert used == pytest.approx({0: 41.883 + 4.644 + both, 2: 30.601 - 4.644 + both + 4.644})
    assert sum(used.values()) == pytest.approx(92.756)


def test_a_log_without_iterations_is_refused_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "info.log").write_text("0.00.094.541 I srv  update_slots: all slots are idle\n")
    with pytest.raises(ValueError, match=r"info\.log: no iteration in it"):
        read_engine_log(tmp_path / "info.log")


def _stamp(at_us: int) -> str:
    minutes, rest = divmod(at_us, 60_000_000)
    seconds, rest = divmod(rest, 1_000_000)
    return f"{minutes}.{seconds:02d}.{rest // 1000:03d}.{rest % 1000:03d}"


def _render(steps: list[tuple[int, list[int], dict[int, int]]], predict: int) -> str:
    """A log in the engine's format: per iteration, its prompts, its start after ``gap`` µs, its tokens."""
    lines, at, generated = [], 1_000_000, dict[int, int]()
    for gap_us, decoded, prefilled in steps:
        for task, tokens in prefilled.items():
            lines.append(f"{_stamp(at)} I slot   operator(): id  0 | task {task} | new prompt, n_keep = 0, "
                         f"task.n_tokens = {tokens}")  # fmt: skip
        lines.append(f"{_stamp(at)} D srv        decode: n_batch (effective) = 2048, off = 0")
        at += gap_us
        for task in [*prefilled, *decoded]:
            generated[task] = generated.get(task, 0) + 1
            lines.append(f"{_stamp(at)} D slot process_toke: id  0 | task {task} | n_gen = {generated[task]}, "
                         f"n_remaining = {predict - generated[task]}, next token: 1 'a'")  # fmt: skip
    lines.append(f"{_stamp(at)} I srv  update_slots: all slots are idle")
    return "\n".join(lines) + "\n"


_STEP = st.tuples(
    st.integers(100, 500_000),
    st.lists(st.integers(0, 7), max_size=8, unique=True),
    st.dictionaries(st.integers(8, 15), st.integers(1, 4000), max_size=4),
)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=30).filter(lambda s: any(d or p for _, d, p in s)))
def test_the_shares_add_up_to_the_iterations_that_ran_someone(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[int, list[int], dict[int, int]]]
) -> None:
    path = tmp_path_factory.mktemp("log") / "server.log"
    path.write_text(_render(steps, predict=10_000))
    log = read_engine_log(path)
    used = gpu_ms_by_task(log)
    assert [round(it.ms * 1000) for it in log.iterations] == [gap for gap, _, _ in steps]
    ran_someone = sum(it.ms for it in log.iterations if it.decoded or it.prefilled)
    assert sum(used.values()) == pytest.approx(ran_someone, rel=1e-9, abs=1e-9)
    assert all(ms >= 0 for ms in used.values())
    assert set(log.n_predict.values()) == {10_000}
