import errno
import logging
import os
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.objects import HEADER_SIZE, check_object
from kvtier.tiers.arena import ALIGNMENT, align_up
from kvtier.tiers.disk import LOCK_NAME, DiskTier
from kvtier_testing.another_user import is_root, run_as_nobody, shared_folder
from kvtier_testing.page_cache import cached, drop
from kvtier_testing.tier_objects import key, obj, plant, size, wait_until

LOGGER = "kvtier.tiers.disk"


def object_file(base: Path, i: int) -> Path:
    return base / f"{key(i).hex()}.kv"


def files_on_disk(base: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in base.iterdir() if p.is_file() and p.name != LOCK_NAME}


def check_capacity(t: DiskTier, capacity: int) -> None:
    assert t.usage().used_bytes <= capacity
    assert sum(files_on_disk(t.path).values()) <= capacity


@pytest.fixture
def tier(disk_tier):
    return disk_tier


def test_put_of_a_stored_object_keeps_the_file(tier):
    tier.put([(key(1), obj(1))])
    inode = object_file(tier.path, 1).stat().st_ino
    assert tier.put([(key(1), obj(1))]) == [True]
    assert object_file(tier.path, 1).stat().st_ino == inode and tier.stats.puts == 1



def test_trailing_bytes_after_the_object_are_not_stored(tier):
    assert tier.put([(key(1), obj(1) + b"junk")]) == [True]
    assert bytes(tier.get([key(1)])[0]) == obj(1) and object_file(tier.path, 1).stat().st_size == size()


def test_delete_and_clear_remove_files(tier):
    tier.put([(key(i), obj(i)) for i in range(4)])
    assert tier.delete([key(0), key(0), key(9)]) == 1
    assert not object_file(tier.path, 0).exists() and tier.get([key(0)]) == [None]
    assert tier.clear() == 3
    assert files_on_disk(tier.path) == {} and tier.usage().used_bytes == 0 and tier.usage().objects == 0



def test_read_ahead_reads_the_run_of_files_held_from_the_first_key(tier):
    """The files of a batch come off the disk together, not one per ``get_into`` in turn; only
    the run the tier holds from the first key (past a key it lacks, a read would miss anyway)."""
    tier.put([(key(i), obj(i)) for i in (0, 1, 3)])
    files = {i: object_file(tier.path, i) for i in (0, 1, 3)}
    drop(files.values())
    assert not any(cached(f) for f in files.values())
    tier.read_ahead([key(0), key(1), key(2), key(3)])
    wait_until(lambda: cached(files[0]) and cached(files[1]), timeout_s=10)
    assert not cached(files[3])
    assert [bytes(v) for v in tier.get([key(0), key(1)])] == [obj(0), obj(1)]


def test_second_tier_on_the_same_directory_is_refused_until_the_first_closes(tier):
    with pytest.raises(ConfigError, match="in use"):
        DiskTier(tier.path, max_capacity_bytes=1 << 20)
    tier.close()
    DiskTier(tier.path, max_capacity_bytes=1 << 20).close()


def test_leftover_temp_files_are_removed_at_start(tmp_path):
    leftover = tmp_path / f".{key(1).hex()}.tmp.12345.0123abcd"
    plant(leftover, obj(1)[:50])
    t = DiskTier(tmp_path, max_capacity_bytes=1 << 20)
    assert not leftover.exists() and t.usage().objects == 0 and t.stats.extra["temp_files_removed"] == 1


def flip_a_payload_byte(base: Path) -> None:
    data = bytearray(object_file(base, 1).read_bytes())
    data[HEADER_SIZE + 5] ^= 0x01
    object_file(base, 1).write_bytes(data)


def truncate(base: Path) -> None:
    os.truncate(object_file(base, 1), size() - 1)


def empty(base: Path) -> None:
    os.truncate(object_file(base, 1), 0)


def another_keys_content(base: Path) -> None:
    os.replace(object_file(base, 2), object_file(base, 1))


def garbage(base: Path) -> None:
    object_file(base, 1).write_bytes(os.urandom(size()))


@pytest.mark.parametrize("damage", [flip_a_payload_byte, truncate, empty, another_keys_content, garbage])
def test_corrupt_file_is_a_miss(tier, damage):
    tier.put([(key(1), obj(1)), (key(2), obj(2))])
    damage(tier.path)
    assert tier.get([key(1)]) == [None]
    assert not object_file(tier.path, 1).exists()
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1
    assert tier.contains([key(1)]) == [False]
    assert tier.usage().used_bytes >= sum(files_on_disk(tier.path).values())


def test_corrupt_file_found_at_start_is_a_miss_after_restart(tmp_path):
    first = DiskTier(tmp_path, max_capacity_bytes=1 << 20)
    first.put([(key(1), obj(1))])
    first.close()
    flip_a_payload_byte(tmp_path)
    second = DiskTier(tmp_path, max_capacity_bytes=1 << 20)
    assert second.get([key(1)]) == [None] and second.stats.corrupt == 1 and not object_file(tmp_path, 1).exists()


def test_file_deleted_behind_our_back_is_a_miss_and_leaves_the_index(tier):
    tier.put([(key(1), obj(1))])
    object_file(tier.path, 1).unlink()
    assert tier.get([key(1)]) == [None]
    assert tier.contains([key(1)]) == [False] and tier.usage().used_bytes == 0 and tier.stats.corrupt == 0


def test_foreign_named_files_are_left_alone(tmp_path, caplog):
    foreign = [
        tmp_path / "notes.txt",
        tmp_path / f"{key(0xABCDEF).hex().upper()}.kv",
        tmp_path / f"{key(1).hex()}.kv.bak",
        tmp_path / ".hidden",
        tmp_path / "subdir" / f"{key(2).hex()}.kv",
    ]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * 100)
    (tmp_path / f"{key(3).hex()}.kv").symlink_to(tmp_path / "notes.txt")  # valid name, but a link out
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t = DiskTier(tmp_path, max_capacity_bytes=size())
    assert t.stats.extra["foreign_files"] == 6 and "not kvtier's" in caplog.text
    assert t.usage().used_bytes == 0 and t.get([key(3)]) == [None]
    t.put([(key(4), obj(4))])
    t.put([(key(5), obj(5))])  # evicts 4, and nothing else
    t.clear()
    assert all(path.exists() for path in foreign) and (tmp_path / f"{key(3).hex()}.kv").is_symlink()


def test_object_bigger_than_the_capacity_is_refused(tmp_path):
    t = DiskTier(tmp_path, max_capacity_bytes=size(2))
    t.put([(key(1), obj(1))])
    assert t.put([(key(2), obj(2, 3))]) == [False]
    assert t.stats.rejected_puts == 1 and t.contains([key(1)]) == [True]


def test_lru_evicts_the_least_recently_used(tmp_path):
    t = DiskTier(tmp_path, max_capacity_bytes=3 * size())
    t.put([(key(i), obj(i)) for i in (1, 2, 3)])
    t.get([key(1)])  # 2 is now the least recently used
    t.put([(key(4), obj(4))])
    assert t.contains([key(1), key(2), key(3), key(4)]) == [True, False, True, True]
    assert (t.stats.evictions, t.stats.evicted_bytes) == (1, size())
    assert not object_file(tmp_path, 2).exists()


def test_fifo_policy_ignores_reads(tmp_path):
    t = DiskTier(tmp_path, max_capacity_bytes=3 * size(), eviction_policy="FIFO")
    t.put([(key(i), obj(i)) for i in (1, 2, 3)])
    t.get([key(1)])
    t.put([(key(4), obj(4))])
    assert t.contains([key(1), key(2)]) == [False, True]


def test_restart_with_a_smaller_capacity_evicts_the_oldest_down_to_it(tmp_path):
    first = DiskTier(tmp_path, max_capacity_bytes=1 << 20)
    first.put([(key(i), obj(i)) for i in range(1, 6)])
    first.close()
    for i in range(1, 6):  # stored in order 1..5, a second apart (timestamps are coarser than puts)
        os.utime(object_file(tmp_path, i), ns=(i * 10**9, i * 10**9))
    second = DiskTier(tmp_path, max_capacity_bytes=2 * size())
    assert second.contains([key(i) for i in range(1, 6)]) == [False, False, False, True, True]
    assert second.usage().used_bytes == 2 * size() == sum(files_on_disk(tmp_path).values())
    assert second.stats.evictions == 3


def test_default_capacity_is_bounded_by_the_free_space(tmp_path):
    t = DiskTier(tmp_path)
    assert 0 < t.usage().capacity_bytes <= os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_capacity_bytes": -1},
        {"max_capacity_bytes": 0},
        {"max_capacity_bytes": 1.5},
        {"max_capacity_bytes": True},
        {"eviction_policy": "random"},
    ],
)
def test_bad_arguments_are_refused(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        DiskTier(tmp_path, **kwargs)


def test_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        DiskTier(tmp_path / "file", max_capacity_bytes=1 << 20)
    with pytest.raises(ConfigError):
        DiskTier(tmp_path / "file" / "below", max_capacity_bytes=1 << 20)


def test_missing_directory_is_created(tmp_path):
    DiskTier(tmp_path / "a" / "b", max_capacity_bytes=1 << 20).put([(key(1), obj(1))])
    assert object_file(tmp_path / "a" / "b", 1).exists()


def test_odirect_works_or_falls_back_with_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t = DiskTier(tmp_path, max_capacity_bytes=1 << 20, use_odirect=True)
        assert t.put([(key(i), obj(i, i)) for i in range(1, 4)]) == [True] * 3
        assert [bytes(b) for b in t.get([key(i) for i in range(1, 4)])] == [obj(i, i) for i in range(1, 4)]
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    padded = t.odirect
    assert len(warnings) == (0 if padded else 1)
    expected = [align_up(size(i)) if padded else size(i) for i in range(1, 4)]
    assert sorted(files_on_disk(tmp_path).values()) == expected and t.usage().used_bytes == sum(expected)
    assert not [name for name in os.listdir(tmp_path) if ".tmp." in name]  # the probe file is gone


def test_odirect_refused_by_the_filesystem_falls_back_with_exactly_one_warning(tmp_path, caplog, monkeypatch):
    real_open = os.open

    def no_odirect(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_odirect)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        t = DiskTier(tmp_path, max_capacity_bytes=1 << 20, use_odirect=True)
        t.put([(key(i), obj(i)) for i in range(3)])
        assert [bytes(b) for b in t.get([key(i) for i in range(3)])] == [obj(i) for i in range(3)]
    assert len(caplog.records) == 1 and "O_DIRECT" in caplog.records[0].getMessage()
    assert t.usage().used_bytes == 3 * size()


def test_odirect_reads_files_written_without_it(tmp_path):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    buffered = DiskTier(tmp_path, max_capacity_bytes=1 << 20)
    buffered.put([(key(1), obj(1, 5))])
    buffered.close()
    direct = DiskTier(tmp_path, max_capacity_bytes=1 << 20, use_odirect=True)
    assert bytes(direct.get([key(1)])[0]) == obj(1, 5)


@pytest.mark.parametrize(
    "failing,error",
    [("open", errno.EROFS), ("replace", errno.EACCES), ("write", errno.ENOSPC), ("fsync", errno.EIO)],
)
def test_io_errors_fail_the_put_and_reads_still_work(tier, monkeypatch, caplog, failing, error):
    tier.put([(key(1), obj(1))])
    real = getattr(os, failing)

    def fail(*args, **kwargs):
        if failing == "open" and not args[1] & os.O_CREAT:
            return real(*args, **kwargs)  # reads still open files
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(os, failing, fail)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tier.put([(key(2), obj(2)), (key(3), obj(3))]) == [False, False]
    assert tier.stats.errors == 2 and len(caplog.records) == 1  # warned once, counted twice
    assert bytes(tier.get([key(1)])[0]) == obj(1)
    assert set(files_on_disk(tier.path)) == {object_file(tier.path, 1).name}  # no temp file left
    assert tier.usage().used_bytes == size() and tier.contains([key(2)]) == [False]


def test_undeletable_file_keeps_counting_against_the_capacity(tmp_path, monkeypatch):
    t = DiskTier(tmp_path, max_capacity_bytes=size())
    t.put([(key(1), obj(1))])

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "unlink", read_only)
    assert t.put([(key(2), obj(2))]) == [False]
    assert t.usage().used_bytes == size() and t.contains([key(1)]) == [True] and t.stats.errors == 1


@pytest.mark.parametrize("use_odirect", [False, True])
def test_capacity_is_never_exceeded(use_odirect):
    capacity = 6 * ALIGNMENT

    @settings(max_examples=25, deadline=None)
    @given(
        st.lists(
            st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 9), st.integers(1, 40)),
            max_size=30,
        )
    )
    def run(ops):
        with tempfile.TemporaryDirectory() as base:
            t = DiskTier(base, max_capacity_bytes=capacity, use_odirect=use_odirect)
            try:
                for op, i, tokens in ops:
                    if op == "put":
                        stored = t.put([(key(i), obj(i, tokens))])[0]
                        assert stored == t.contains([key(i)])[0]
                    elif op == "get":
                        got = t.get([key(i)])[0]
                        assert got is None or check_object(got, key(i))  # whole, and key(i)'s
                    else:
                        t.delete([key(i)])
                    check_capacity(t, capacity)
                    assert t.usage().used_bytes == sum(files_on_disk(t.path).values())
            finally:
                t.close()

    run()


def test_concurrent_puts_and_gets_never_exceed_the_capacity(tmp_path):
    capacity = 10 * size(4)
    t = DiskTier(tmp_path, max_capacity_bytes=capacity)
    failures = []

    def worker(offset):
        try:
            for n in range(60):
                i = offset * 1000 + n % 20
                t.put([(key(i), obj(i, 4))])
                got = t.get([key(i)])[0]
                assert got is None or bytes(got) == obj(i, 4)
                assert t.usage().used_bytes <= capacity  # files are checked at the end: a listing is no snapshot
        except BaseException as e:  # any error in a thread fails the test, not only a failed assert
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and t.stats.corrupt == 0 and t.stats.errors == 0
    check_capacity(t, capacity)
    assert t.usage().used_bytes == sum(files_on_disk(tmp_path).values())


def test_block_records_live_beside_their_objects_and_survive_a_restart(tmp_path):
    base = tmp_path / "l2"
    t = DiskTier(base, max_capacity_bytes=3 * size() + 300)
    assert t.put([(key(1), obj(1)), (key(2), obj(2))], [b"record-1" * 10, b""]) == [True, True]
    assert t.record_of(key(1)) == b"record-1" * 10 and t.record_of(key(2)) == b""
    assert sorted(t.records()) == [(key(1), b"record-1" * 10)]
    assert t.usage().used_bytes == 2 * size() + 80  # a record's bytes count against the capacity
    plant(base / f"{key(9).hex()}.blocks", b"orphan")  # a crash between the two writes
    t.close()
    t = DiskTier(base, max_capacity_bytes=3 * size() + 300)
    assert t.record_of(key(1)) == b"record-1" * 10 and t.usage().used_bytes == 2 * size() + 80
    assert not (base / f"{key(9).hex()}.blocks").exists()
    t.put([(key(3), obj(3))], [b"r" * 400])  # needs room: the oldest object goes, with its record
    assert not t.contains([key(1)])[0] and t.record_of(key(1)) == b""
    assert not (base / f"{key(1).hex()}.blocks").exists()
    check_capacity(t, 3 * size() + 300)
    t.delete([key(3)])
    assert t.records() == [] and not (base / f"{key(3).hex()}.blocks").exists()
    t.close()


# -- the files are the server's user's alone ---------------------------------------------------------


def _tier_with_every_kind_of_file(base: Path) -> DiskTier:
    """A tier holding an object with a block record and a tenant file, made under umask 0: the
    modes must not depend on the umask."""
    previous = os.umask(0)
    try:
        t = DiskTier(base, max_capacity_bytes=1 << 20)
        assert t.put([(key(1), obj(1))], [b"token ids and salt"], tenant="team-a") == [True]
    finally:
        os.umask(previous)
    return t


def _every_file(base: Path) -> list[Path]:
    return [base / f"{key(1).hex()}.{suffix}" for suffix in ("kv", "blocks", "tenant")] + [base / LOCK_NAME]


#: As nobody: what it can list, read or lock of the tier's folder and files.
_OUTSIDER = """
import fcntl, json, os, sys
become_nobody()
folder, files = sys.argv[1], sys.argv[2:]
got = []
try:
    got.append(("listed", sorted(os.listdir(folder))))
except OSError:
    pass
for path in files:
    try:
        with open(path, "rb") as f:
            got.append(("read", path))
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got.append(("locked", path))
    except OSError:
        pass
print(json.dumps(got))
"""


def test_another_user_can_read_no_file_and_cannot_take_the_lock():
    """Folder 0700, every file 0600 from its creation (object, block record, tenant file, lock),
    whatever the umask: another user lists nothing, reads nothing, and cannot hold the lock to
    keep the server from starting again."""
    with shared_folder() as shared:
        t = _tier_with_every_kind_of_file(shared / "l2")
        try:
            if is_root():  # no file mode stops root; as non-root, the modes below are the check
                assert run_as_nobody(_OUTSIDER, str(t.path), *map(str, _every_file(t.path))) == []
            assert os.stat(t.path).st_mode & 0o777 == 0o700
            assert {path.name: path.stat().st_mode & 0o777 for path in _every_file(t.path)} == {
                path.name: 0o600 for path in _every_file(t.path)}
        finally:
            t.close()
        DiskTier(shared / "l2", max_capacity_bytes=1 << 20).close()  # nobody held the lock


def _widen_folder(base: Path) -> None:
    base.chmod(0o755)


def _widen_object(base: Path) -> None:
    (base / f"{key(1).hex()}.kv").chmod(0o644)


def _widen_record(base: Path) -> None:
    (base / f"{key(1).hex()}.blocks").chmod(0o640)


def _widen_tenant_file(base: Path) -> None:
    (base / f"{key(1).hex()}.tenant").chmod(0o604)


def _widen_lock(base: Path) -> None:
    (base / LOCK_NAME).chmod(0o644)


def _give_a_file_away(base: Path) -> None:
    os.chown(base / f"{key(1).hex()}.kv", 65534, 65534)


@pytest.mark.parametrize("widen", [_widen_folder, _widen_object, _widen_record, _widen_tenant_file, _widen_lock]
                         + ([_give_a_file_away] if is_root() else []))
def test_a_cache_other_users_may_read_or_write_is_refused_with_the_fix_and_kept(tmp_path, widen):
    """A cache an older kvtier wrote (0755/0644), or one with a file another user owns, is
    refused at start, naming the file and the command that fixes it; nothing is deleted, and
    after the fix the tier starts with its object, record and tenant."""
    base = tmp_path / "l2"
    _tier_with_every_kind_of_file(base).close()
    widen(base)
    before = sorted(p.name for p in base.iterdir())
    with pytest.raises(ConfigError, match="other users") as refused:
        DiskTier(base, max_capacity_bytes=1 << 20)
    assert f"chmod -R go-rwx {base}" in str(refused.value)
    assert sorted(p.name for p in base.iterdir()) == before
    if widen is _give_a_file_away:
        assert f"chown -R {os.geteuid()} {base}" in str(refused.value)
        os.chown(base / f"{key(1).hex()}.kv", os.geteuid(), os.getegid())
    for path in (base, *base.iterdir()):
        path.chmod(path.stat().st_mode & 0o700)
    t = DiskTier(base, max_capacity_bytes=1 << 20)
    assert bytes(t.get([key(1)])[0]) == obj(1)
    assert t.record_of(key(1)) == b"token ids and salt" and t.tenant_of(key(1)) == "team-a"
    t.close()
