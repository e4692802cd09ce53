"""The newest-first listings (`overnight ls`, /ui) read from the last days back."""

from __future__ import annotations

from overnight.storage import LogWriter, WriterConfig, now_us, open_db
from overnight.view.display import list_groups, newest_groups

from .helpers import completion_row

HOUR_US = 3_600_000_000


def write_turns(data_dir, turns: list[tuple[str, int]]) -> None:
    """(group, hours ago) per turn; each group's turns in one rollout."""
    writer = LogWriter(WriterConfig(data_dir, commit_interval=0.0))
    writer.start()
    for i, (group, hours_ago) in enumerate(turns):
        at = now_us() - hours_ago * HOUR_US
        row = completion_row(f"{group}.0", group, started_at=at, ended_at=at, turn_index=i)
        writer.append("completions", {**row, "record_id": f"{group}.{i}"})
    writer.close()


def test_newest_groups_widen_their_window_until_they_have_enough(tmp_path):
    # "old" began 40 days ago and had a turn an hour ago: newest by its end, oldest by
    # its start. The others are 3 days, 10 days and 2 hours old.
    write_turns(tmp_path, [("old", 960), ("old", 1), ("d10", 240), ("d3", 72), ("h2", 2)])
    con = open_db(tmp_path)
    by_start = [g for (g,) in newest_groups(con, "group_id", "started_at", 3)]
    assert by_start == ["h2", "d3", "d10"]
    by_end = [g for (g,) in newest_groups(con, "group_id", "ended_at", 2)]
    assert by_end == ["old", "h2"]
    every = newest_groups(con, "group_id, rollouts", "started_at", 10)
    assert every == [("h2", 1), ("d3", 1), ("d10", 1), ("old", 1)]
    filtered = newest_groups(con, "group_id", "started_at", 2, ["group_id <> ?"], ["h2"])
    assert filtered == [("d3",), ("d10",)]
    assert newest_groups(open_db(tmp_path / "empty"), "group_id", "ended_at", 5) == []
    listing = list_groups(con, None, 2)
    assert listing.startswith("4 group(s), 4 rollout(s); newest 2 shown")
    assert listing.index("group old:") < listing.index("group h2:")
