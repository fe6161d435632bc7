"""Kafka transactions: the transaction coordinator and what each partition keeps of them.

``coordinator`` owns every transactional id's state (durable in the metadata store, table
``kafka_txn_state``); ``partition_txns`` is the per-partition part (ongoing transactions, last
stable offset, aborted-transaction index); ``markers`` encodes COMMIT/ABORT control batches.
"""
from __future__ import annotations

from .coordinator import (TransactionCoordinator, coordinator_for, ensure_transactions,
                          stop_transactions)
from .partition_txns import PartitionTxns

__all__ = ["TransactionCoordinator", "coordinator_for", "ensure_transactions", "stop_transactions",
           "PartitionTxns"]
