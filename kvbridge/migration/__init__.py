"""Request migration between engines: plan, pools, local execution and distributed transport."""

from kvbridge.migration.errors import ChecksumError, MigrationError, TransferError
from kvbridge.migration.execute import (
    ConvertSide,
    MigrationReport,
    Payload,
    convert_payload,
    migrate_local,
    pack,
    publish,
    verify,
)
from kvbridge.migration.plan import MigrationPlan, Transfer, live_entries, plan_migration
from kvbridge.migration.pools import EnginePools, RequestTables, gather_records, scatter_records, table_of
from kvbridge.migration.synthetic import destination_pools, fill_synthetic, source_request

__all__ = [
    "ChecksumError",
    "ConvertSide",
    "EnginePools",
    "MigrationError",
    "MigrationPlan",
    "MigrationReport",
    "Payload",
    "RequestTables",
    "Transfer",
    "TransferError",
    "convert_payload",
    "destination_pools",
    "fill_synthetic",
    "gather_records",
    "live_entries",
    "migrate_local",
    "pack",
    "plan_migration",
    "publish",
    "scatter_records",
    "source_request",
    "table_of",
    "verify",
]
