"""devices.progress: the lines long phases print, with their rate and the time left."""

from rag_jax.devices import progress


def test_durations_read_as_people_read_them():
    assert [progress.duration(s) for s in (0.4, 42, 185, 7620)] == [
        "0 s",
        "42 s",
        "3 min 05 s",
        "2 h 07 min",
    ]


def test_a_line_every_interval_with_the_rate_and_time_left(monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    eta = progress.Eta("corpus encoding", 1000, "passages", start=200, every_s=30)
    now[0] = 110.0
    eta.update(300)  # 10 s in: too soon for a line
    assert capsys.readouterr().out == ""
    now[0] = 140.0
    eta.update(400, "loss 1.234")  # 40 s for 200 passages: 5/s, 600 left
    assert capsys.readouterr().out == (
        "corpus encoding: 400 of 1000 passages (5/s), 2 min 00 s left, loss 1.234\n"
    )
    now[0] = 141.0
    eta.update(1000)  # the end is always said
    assert "1000 of 1000 passages" in capsys.readouterr().out and eta.done == 1000
