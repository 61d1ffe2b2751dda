"""Where the package's warnings point (gdn_jax.diagnostics): at the user's line, from the package's threads too (warm-up
loads its stored executables on two), never at the thread pool's."""

import concurrent.futures
import functools
import warnings

from gdn_jax import diagnostics
from gdn_jax.worker import executable_store as executables


def _damaged_entry(folder) -> str:
    """A store folder whose entry "k" is damaged (its digest does not match the rest)."""
    folder.mkdir()
    (folder / "k").write_bytes(b"\0" * 40)
    return str(folder)


def test_a_store_warning_from_warm_ups_loading_threads_points_at_the_users_line(tmp_path):
    folders = [_damaged_entry(tmp_path / "a"), _damaged_entry(tmp_path / "b")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = diagnostics.map_on_threads(functools.partial(executables.load, key="k"), folders, threads=2)
    assert found == [None, None]
    assert [w.filename for w in caught] == [__file__, __file__], [(w.filename, w.lineno) for w in caught]
    assert all(f"{folder}/k does not load" in str(w.message) for w, folder in zip(caught, folders))


def test_a_warning_on_another_thread_points_at_the_packages_call_not_the_thread_pool(tmp_path):
    """Without `map_on_threads` a thread's stack holds no user's line: the warning names the package's outermost
    frame there (here the store's `load`), not concurrent/futures/thread.py."""
    folder = _damaged_entry(tmp_path / "a")
    with warnings.catch_warnings(record=True) as caught, concurrent.futures.ThreadPoolExecutor(1) as pool:
        warnings.simplefilter("always")
        assert pool.submit(executables.load, folder, "k").result() is None
    assert [w.filename for w in caught] == [executables.__file__], [(w.filename, w.lineno) for w in caught]
