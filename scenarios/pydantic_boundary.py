"""Validating args and results at the application boundary with Pydantic v2 models.

What this shows:
    * the producer builds args from a model (model_dump(mode="json")), so only valid, JSON-safe
      data is enqueued (datetimes become ISO strings, Decimals strings);
    * the handler parses ctx.args back into the model and returns a validated result model;
    * a job whose stored args do not match the model fails with the ValidationError before
      doing any work (enqueued here with max_attempts=1: a retry would not make it valid).
jobq.py itself never imports Pydantic: this lives in your code.

It ends with a verdict line (exit status 1 if the run did not show it).

Run:
    python scenarios/pydantic_boundary.py                  # needs: pip install 'pydantic>=2' (else: exit 2)
    python scenarios/pydantic_boundary.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import datetime as dt
import decimal
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

try:
    import pydantic
except ImportError:
    print("pydantic_boundary.py needs Pydantic v2: pip install 'pydantic>=2' (jobq itself does not)", file=sys.stderr)
    sys.exit(2)

import jobq


class InvoiceArgs(pydantic.BaseModel):
    customer: str
    amount: decimal.Decimal
    due: dt.date


class InvoiceResult(pydantic.BaseModel):
    invoice_no: str
    total_cents: int


def send_invoice(ctx: jobq.JobContext) -> dict:
    args = InvoiceArgs.model_validate(ctx.args)  # raises ValidationError on bad stored data
    result = InvoiceResult(invoice_no=f"INV-{ctx.id:05d}", total_cents=int(args.amount * 100))
    return result.model_dump(mode="json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'pyd.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    good = InvoiceArgs(customer="ACME", amount=decimal.Decimal("12.50"), due=dt.date(2027, 1, 31))
    ok_id = jobq.enqueue(engine, "send_invoice", good.model_dump(mode="json"))
    bad_id = jobq.enqueue(engine, "send_invoice", {"customer": "Initech", "amount": "lots"}, max_attempts=1)
    refused = False
    try:
        jobq.enqueue(engine, "send_invoice", good.model_dump())  # not JSON-safe: Decimal, date
    except jobq.InvalidJob as exc:
        refused = True
        print(f"refused at enqueue, nothing written: {exc}")
    jobq.Worker(engine, {"send_invoice": send_invoice}, max_concurrency=2, poll_interval=0.05).run_until_idle(timeout=60)
    ok = InvoiceResult.model_validate(jobq.get(engine, ok_id).result)  # type: ignore[union-attr]
    print(f"job {ok_id}: done, result parsed back into InvoiceResult: {ok!r}")
    bad = jobq.get(engine, bad_id)
    first_line = bad.error.splitlines()[0]  # type: ignore[union-attr]
    print(f"job {bad_id}: {bad.state}; first line of the error: {first_line}")  # type: ignore[union-attr]
    shown = refused and ok.total_cents == 1250 and bad.state == "failed" and first_line.startswith("ValidationError")  # type: ignore[union-attr]
    print(f"verdict: {'OK' if shown else 'NOT SHOWN'}: non-JSON args refused at enqueue; valid args round-tripped "
          f"through the model ({ok.total_cents} cents); invalid stored args failed with a ValidationError, no retry")
    sys.exit(0 if shown else 1)


if __name__ == "__main__":
    main()
