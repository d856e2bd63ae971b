"""Schema: idempotent creation, the ready index per dialect, time precision, version gates."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs, only
from helpers import META, recorded_version


def test_create_schema_is_idempotent(engine: sa.Engine) -> None:
    """create_schema twice: the tables exist, and jobq_meta holds exactly the schema version, the
    claim-lock row, the global limits and retention's turn; the second call neither fails nor
    duplicates them."""
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    names = set(sa.inspect(engine).get_table_names())
    assert {"jobs", "job_deps", "jobq_meta"} <= names
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.select(META.c.key, META.c.value)).all())
    assert rows == {"schema_version": str(jobq.SCHEMA_VERSION), "claim_lock": "", "global_limits": "",
                    "retention_due": ""}


def test_ready_index_exists_in_the_dialects_form(engine: sa.Engine) -> None:
    """PostgreSQL/SQLite get a partial index WHERE state = 'ready'; MySQL/MariaDB, which have
    no partial indexes, a composite index led by state. A bug would leave the scan O(table)."""
    idx = {i["name"]: i for i in sa.inspect(engine).get_indexes("jobs")}
    if engine.dialect.name in ("mysql", "mariadb"):
        assert idx["ix_jobs_ready_my"]["column_names"] == ["state", "group_key", "priority", "run_after", "id"]
        assert "ix_jobs_ready" not in idx
    else:
        assert idx["ix_jobs_ready"]["column_names"] == ["group_key", "priority", "run_after", "id"]
        where = idx["ix_jobs_ready"]["dialect_options"]
        assert "ready" in str(where.get("postgresql_where", where.get("sqlite_where")))
        assert "ix_jobs_ready_my" not in idx


def test_times_keep_microseconds_and_are_utc(engine: sa.Engine) -> None:
    """MySQL rounds and MariaDB truncates a plain DATETIME; SQLite drops offsets. An aware
    run_after in another zone must come back as the same instant, in UTC, to the microsecond."""
    when = dt.datetime(2031, 5, 6, 7, 8, 9, 123457, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30)))
    jid = jobq.enqueue(engine, "t", run_after=when)
    info = jobq.get(engine, jid)
    assert info is not None
    assert info.run_after == dt.datetime(2031, 5, 6, 1, 38, 9, 123457, tzinfo=dt.UTC) == when
    assert info.created_at.microsecond == info.updated_at.microsecond


def test_version_gate_names_found_and_needed_versions() -> None:
    """A server older than jobq supports is refused with UnsupportedDatabase naming the version
    found and the one needed; the minimum versions themselves pass."""
    with pytest.raises(jobq.UnsupportedDatabase, match=r"MySQL 5\.7\.44 found; jobq needs MySQL 8\.0\.1"):
        jobq._check_version("mysql", (5, 7, 44))
    with pytest.raises(jobq.UnsupportedDatabase, match=r"MariaDB 10\.5\.9 found; jobq needs MariaDB 10\.6"):
        jobq._check_version("mariadb", (10, 5, 9))
    jobq._check_version("mysql", (8, 0, 1))
    jobq._check_version("mariadb", (10, 6, 0))


def test_unknown_dialect_is_refused() -> None:
    """A database jobq does not know (a dialect named oracle here) is refused with
    UnsupportedDatabase naming it, before anything is created."""
    eng = sa.create_engine("sqlite://")
    eng.dialect.name = "oracle"  # the name is all jobq looks at before connecting
    with pytest.raises(jobq.UnsupportedDatabase, match="oracle"):
        jobq.create_schema(eng)


@only("mariadb")  # MariaDB reached through a mysql:// URL
def test_mariadb_is_recognised_through_a_mysql_url(dialect: str) -> None:
    """mysql+pymysql:// URLs that reach MariaDB report dialect 'mysql' with is_mariadb."""
    from dbs import server_url

    url = server_url("mariadb").replace("mariadb+pymysql", "mysql+pymysql")
    eng = sa.create_engine(url)
    assert jobq._prepare(eng).family == "mariadb"
    eng.dispose()


def _parent_keys(engine: sa.Engine) -> list[dict]:
    return [fk for fk in sa.inspect(engine).get_foreign_keys("jobs") if fk["constrained_columns"] == ["parent_id"]]


def test_parent_key_exists_except_on_oracle_mysql(engine: sa.Engine, dialect: str) -> None:
    """jobs.parent_id references jobs.id on every engine but Oracle MySQL, which checks the key
    on every update of a jobs row, parent_id changed or not (a claim's lease of 64 rows took 2.6x
    as long). There create_schema drops the key that a database made before this still has,
    and the next call finds nothing to do. The bug either way: a key where every claim pays
    for it, or integrity dropped where it costs nothing."""
    jobq.create_schema(engine)
    if dialect != "mysql":
        assert [fk["referred_table"] for fk in _parent_keys(engine)] == ["jobs"]
        return
    assert _parent_keys(engine) == []
    with engine.begin() as conn:  # as every create_schema before this made it
        conn.exec_driver_sql("ALTER TABLE jobs ADD FOREIGN KEY (parent_id) REFERENCES jobs (id)")
    recorded_version(engine, 4)
    assert len(_parent_keys(engine)) == 1
    jobq.create_schema(engine)
    assert _parent_keys(engine) == []
    jobq.create_schema(engine)
    assert _parent_keys(engine) == []


@only("mariadb")  # MariaDB reached through a mysql:// URL
def test_mariadb_keeps_the_parent_key_through_a_mysql_url(dialect: str) -> None:
    """The key is skipped by the server's family, not the URL's: MariaDB reached through a
    mysql+pymysql:// URL keeps it."""
    from dbs import server_url

    eng = sa.create_engine(server_url("mariadb").replace("mariadb+pymysql", "mysql+pymysql"))
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    assert len(_parent_keys(eng)) == 1
    eng.dispose()


@needs("tunable")  # storage parameters
def test_the_jobs_table_is_tuned_for_churn(engine: sa.Engine) -> None:
    """On PostgreSQL the jobs table is created with fillfactor=70 and a low autovacuum scale factor,
    for its constant updates."""
    with engine.connect() as conn:
        opts = conn.exec_driver_sql("SELECT reloptions FROM pg_class WHERE relname = 'jobs'").scalar_one()
    assert "fillfactor=70" in opts and "autovacuum_vacuum_scale_factor=0.02" in opts


def _index_keys(engine: sa.Engine) -> dict[str, list[str]]:
    return {i["name"]: i["column_names"] for i in sa.inspect(engine).get_indexes("jobs")}


@needs(no="partial_indexes")
def test_only_the_ready_index_leads_with_state_on_mysql_and_mariadb(engine: sa.Engine) -> None:
    """Every state change (a claim's lease, a finish) moves an entry of each index that leads
    with state; where partial indexes are missing only the claim's own scan and the due check
    (ix_jobs_due_my: it must tell ready rows apart, see tests/core/test_scheduled.py) may. The
    bug: the finished or held-spawn index keyed (state, ...) again, a write more per row leased."""
    jobq.create_schema(engine)
    keys = _index_keys(engine)
    assert {n for n, cols in keys.items() if cols[0] == "state"} == {"ix_jobs_ready_my", "ix_jobs_due_my"}
    assert keys["ix_jobs_finished_my"] == ["finished_at"] and keys["ix_jobs_held_my"] == ["spawned_by"]


@needs(no="partial_indexes")
def test_state_led_indexes_of_before_are_rekeyed_in_place(engine: sa.Engine, dialect: str) -> None:
    """A database made before the re-keying ((state, finished_at) and (state, spawned_by)) is
    re-keyed by create_schema (twice: idempotent) without losing a row; prune, stats() and
    held spawns then plan on the new keys. The bug either way: state-led indexes kept, or a
    query left to scan the table."""
    jobq.create_schema(engine)
    with engine.begin() as conn:  # as every create_schema before this made them
        conn.exec_driver_sql("DROP INDEX ix_jobs_finished_my ON jobs")
        conn.exec_driver_sql("DROP INDEX ix_jobs_held_my ON jobs")
        conn.exec_driver_sql("CREATE INDEX ix_jobs_state_finished ON jobs (state, finished_at)")
        conn.exec_driver_sql("CREATE INDEX ix_jobs_held_my ON jobs (state, spawned_by)")
    recorded_version(engine, 4)
    now = jobq._utcnow()
    base = dict(type="t", args={}, is_container=False, group_key="g", weight=1, run_after=now, created_at=now,
                updated_at=now, attempts=0, max_attempts=3, in_flight=False, cancel_requested=False, pending_deps=0,
                pending_children=0, failed_children=0)
    with engine.begin() as conn:
        conn.execute(sa.insert(jobq.Job.__table__), [dict(base, state="ready") for _ in range(2000)])
        conn.execute(sa.insert(jobq.Job.__table__), [
            dict(base, state="done", result={}, finished_at=now - dt.timedelta(minutes=i, seconds=30)) for i in range(2000)])
        conn.execute(sa.insert(jobq.Job.__table__), [dict(base, state="held", spawned_by=i) for i in range(1, 200)])
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    keys = _index_keys(engine)
    assert "ix_jobs_state_finished" not in keys
    assert keys["ix_jobs_finished_my"] == ["finished_at"] and keys["ix_jobs_held_my"] == ["spawned_by"]
    d = jobq._prepare(engine)
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE TABLE jobs")
        assert conn.execute(sa.select(sa.func.count()).select_from(jobq.Job.__table__)).scalar() == 4199
        for stmt, want in (
                (jobq._q_prunable(["done"], now - dt.timedelta(hours=32), 100), "ix_jobs_finished_my"),
                (jobq._q_finished_by_state(now - dt.timedelta(minutes=30)), "ix_jobs_finished_my"),
                (jobq._q_held_spawns(d, [5, 6]), "ix_jobs_held_my")):
            sql = str(stmt.compile(engine, compile_kwargs={"literal_binds": True, "render_postcompile": True}))
            explain = "EXPLAIN FORMAT=TRADITIONAL " if dialect == "mysql" else "EXPLAIN "  # MySQL 9: TREE by default
            plan = [dict(r._mapping) for r in conn.exec_driver_sql(explain + sql)]
            top = next(r for r in plan if r["table"] == "jobs")
            assert top["key"] == want, f"{sql}\n{plan}"
    assert jobq.prune(engine, dt.timedelta(hours=32)) == 80  # finished 32 h 0.5 min to 33 h 19.5 min before the test's clock


@needs("partial_indexes")
def test_the_full_parent_index_of_before_is_replaced_by_the_partial_one(engine: sa.Engine) -> None:
    """A database made by an earlier jobq has ix_jobs_parent over every row. create_schema
    (twice: idempotent) makes the partial ix_jobs_children and drops the full index, and
    lookups by parent still work (a container's cancel reaches its children). The bug: both
    indexes kept (every parentless claim and finish still writes the full one), or the old one
    dropped before the new one exists."""
    with engine.begin() as conn:  # as every create_schema before this made it
        conn.exec_driver_sql("DROP INDEX ix_jobs_children")
        conn.exec_driver_sql("CREATE INDEX ix_jobs_parent ON jobs (parent_id)")
    recorded_version(engine, 4)
    box = jobq.enqueue(engine, "box", container=True)
    kids = [jobq.enqueue(engine, "t", parent=box) for _ in range(3)]
    loose = jobq.enqueue(engine, "t")
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    names = {i["name"] for i in sa.inspect(engine).get_indexes("jobs")}
    assert "ix_jobs_children" in names and "ix_jobs_parent" not in names, names
    jobq.cancel(engine, box)
    assert {jobq.get(engine, k).state for k in kids} == {"cancelled"}  # type: ignore[union-attr]
    assert jobq.get(engine, loose).state == "ready"  # type: ignore[union-attr]


def test_every_engine_family_gets_the_claims_indexes_by_capability() -> None:
    """The schema picks indexes by capability, not by engine name: each family either has
    partial indexes (the claim's partial ready indexes) or takes the plain composite stand-ins,
    never neither (a family with neither would claim by scanning every row, silently)."""
    families = [*jobq._MIN_VERSIONS, "sqlite"]
    for family in families:
        facts = jobq._family_facts(family)
        assert facts.partial_indexes != facts.index_hints, (family, facts.partial_indexes, facts.index_hints)
    broken = jobq._Engine("newdb", ())  # BROKEN: an engine with the defaults only
    assert not (broken.partial_indexes or broken.index_hints)  # is what the check above refuses


def test_each_engine_is_a_facts_class_and_its_driver() -> None:
    """The engines (jobq/engines.py) and their drivers (jobq/drivers.py) are one registry each,
    naming the same families in the same order; each driver is its family's facts with the
    shared behaviour, and its label and version floor are what the messages use."""
    assert [e.family for e in jobq._ENGINES] == [d.family for d in jobq._DRIVERS]
    for engine, driver in zip(jobq._ENGINES, jobq._DRIVERS, strict=True):
        assert issubclass(driver, engine) and issubclass(driver, jobq._Dialect), driver
        assert jobq._ENGINE_LABELS[engine.family] == engine.label and jobq._MIN_VERSIONS[engine.family] == engine.min_version
        assert type(jobq._capabilities(engine.family, engine.min_version)) is driver


def test_a_fact_set_without_its_annotation_is_refused() -> None:
    """BROKEN: a family class that sets a fact as a plain class attribute would keep _Engine's
    default (the dataclass field decides the instance's value): refused when the class is made."""
    with pytest.raises(TypeError, match="annotate the facts"):
        type("_Broken", (jobq._SQLite,), {"returning": False})
