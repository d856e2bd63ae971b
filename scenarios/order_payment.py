"""An order pipeline that waits for the payment provider's webhook without holding a slot.

Each order is two jobs: "charge" asks the provider for a payment, then waits for its webhook
(``ctx.wait_for("paid-<order>", timeout=...)``); "ship" runs once the charge is done. The worker
has ONE slot. Three orders wait for their payments at once, and a report job still runs
meanwhile: a waiting job holds no slot. The scenario then plays the provider: it sends the
webhooks of orders 1 and 3 (``jobq.signal``), and never sends order 2's, whose wait times out
(``jobq.WaitTimeout``); its charge then fails for good (``jobq.NoRetry``) and its "ship" with it.

What this shows:
    * ctx.wait_for suspends: lease and slot released, checkpoint kept, no attempt charged;
    * jobq.signal (the webhook) makes the waiting job due; its re-run reads the payload;
    * a timeout: the re-run's wait_for raises WaitTimeout;
    * jobq.why says what a suspended job waits for.

It ends with a verdict line (exit status 1 if what it promises was not shown).

Run:
    python scenarios/order_payment.py                      # SQLite file in a temp directory
    python scenarios/order_payment.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

PAYMENT_TIMEOUT = 3.0  # seconds; a real one would be hours


def charge(ctx: jobq.JobContext) -> dict:
    order = ctx.args["order"]
    if ctx.state is None:  # ask the provider once; a re-run resumes from here
        print(f"  order {order}: payment requested from the provider (attempt {ctx.attempt})", flush=True)
        ctx.checkpoint({"requested": True})
    try:
        paid = ctx.wait_for(f"paid-{order}", timeout=PAYMENT_TIMEOUT)
    except jobq.WaitTimeout:
        print(f"  order {order}: no payment within {PAYMENT_TIMEOUT:g}s", flush=True)
        raise jobq.NoRetry(f"order {order}: the payment never came") from None
    print(f"  order {order}: paid {paid['amount']} (attempt {ctx.attempt})", flush=True)
    return {"amount": paid["amount"], "attempt": ctx.attempt}


def ship(ctx: jobq.JobContext) -> dict:
    print(f"  order {ctx.args['order']}: shipped", flush=True)
    return {"shipped": ctx.args["order"]}


def report(ctx: jobq.JobContext) -> dict:
    print("  report: ran while the orders waited for their payments", flush=True)
    return {}


def wait_until(cond: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            print(f"verdict: NOT SHOWN: timed out waiting for {what}")
            sys.exit(1)
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'orders.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    orders = {}
    for n in (1, 2, 3):
        orders[n] = jobq.submit(engine, [{"key": "charge", "type": "charge", "args": {"order": n}, "group_key": f"shop-{n}"},
                                         {"key": "ship", "type": "ship", "args": {"order": n}, "depends_on": ["charge"]}])
    print("3 orders enqueued; one worker with ONE slot")
    worker = jobq.Worker(engine, {"charge": charge, "ship": ship, "report": report}, max_concurrency=1, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()

    def suspended(job: int) -> bool:
        return [a.outcome for a in jobq.attempts(engine, job)][-1:] == ["suspended"]

    wait_until(lambda: all(suspended(o["charge"]) for o in orders.values()), "the three charges to wait")
    print(f"why: {jobq.why(engine, orders[1]['charge'])}")
    rep = jobq.enqueue(engine, "report", {})
    wait_until(lambda: jobq.get(engine, rep).state == "done", "the report")  # type: ignore[union-attr]
    report_ran_while_waiting = all(jobq.get(engine, o["charge"]).state == "ready" for o in orders.values())  # type: ignore[union-attr]
    for n, amount in ((1, "19.90"), (3, "7.50")):
        print(f"webhook: payment of order {n} received ({amount})")
        jobq.signal(engine, f"paid-{n}", {"amount": amount})
    wait_until(lambda: all(jobq.get(engine, o["ship"]).state in jobq.TERMINAL for o in orders.values()),  # type: ignore[union-attr]
               "every order to finish")
    worker.stop()
    thread.join(30)
    states = {n: (jobq.get(engine, o["charge"]).state, jobq.get(engine, o["ship"]).state)  # type: ignore[union-attr]
              for n, o in orders.items()}
    for n, (c, s) in states.items():
        print(f"order {n}: charge {c}, ship {s}")
    charged = [a.attempt for o in orders.values() for a in jobq.attempts(engine, o["charge"])]
    paid = {n: (jobq.get(engine, orders[n]["charge"]).result or {}).get("amount") for n in (1, 3)}  # type: ignore[union-attr]
    ok = (report_ran_while_waiting and states == {1: ("done", "done"), 2: ("failed", "failed"), 3: ("done", "done")}
          and paid == {1: "19.90", 3: "7.50"} and set(charged) == {1})
    print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: with one slot, a report ran while 3 orders waited for their "
          f"payments; orders 1 and 3 were paid ({paid[1]}, {paid[3]}) and shipped, order 2 timed out and failed "
          f"with its shipment; every charge ran as attempt 1 (waiting charged no attempt)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
