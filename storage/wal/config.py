"""WAL configuration: one dataclass so the engine and the CLI share defaults."""
from __future__ import annotations

from dataclasses import dataclass

SYNC_MODES = ("dsync", "fdatasync", "none")
IO_ENGINES = ("uring", "aio", "threads")
# the engines with which attach_loop() hands the writes to the event loop (LoopDriver)
LOOP_ENGINES = ("uring", "aio")
IO_RETRIES = 5                  # a failed block write is tried this often (either engine) ...
IO_RETRY_DELAY_S = 0.1          # ... this far apart, then the WAL fails


@dataclass
class WALConfig:
    """Options of the Delta WAL (see docs/wal.md for what each one costs)."""

    path: str
    capacity: int = 2 << 30                 # bytes of the device used, incl. two 4 KiB header slots
    block_soft_limit: int = 256 << 10       # a block is sealed once it holds this many bytes
    flush_interval_s: float = 1 / 3000      # minimum gap between sealed blocks (IOPS budget)
    io_threads: int = 4                     # writes in flight (queue depth)
    # "uring" / "aio": once attach_loop() is called, that event loop submits writes itself
    # and reaps them from an eventfd (no IO threads, no GIL hand-offs per write): "uring"
    # through io_uring, writing from the broker's registered frame slabs without per-write
    # page pinning (falls back to libaio, logged once, where io_uring cannot be set up);
    # "aio" through Linux native AIO (libaio). Before attach_loop(), and with "threads",
    # io_threads threads write. Falls back to threads when neither is available or O_DIRECT
    # was refused (buffered writes would block the loop).
    io_engine: str = "uring"
    # writes started as soon as a block is sealed; the other IO threads join only while sealed
    # blocks back up to max_write_bytes (a device falling behind). Fewer parallel small writes
    # at moderate load: fewer thread wake-ups competing with the loop, larger merged writes.
    eager_writes: int = 2
    max_write_bytes: int = 1 << 20          # consecutive sealed blocks merged into one pwritev
    # ... and up to this size while more than twice as much is sealed and waiting (the device
    # is the bottleneck): a device that completes every write in flight behind one flush moves
    # more per flush cycle, and the loop's turn between cycles is paid per fewer bytes
    backlog_write_bytes: int = 2 << 20
    bandwidth_limit: int | None = None      # bytes/s written to the device, None = unlimited
    window_initial: int = 1 << 20           # in-flight span recorded in the header at start
    window_max: int = 512 << 20             # cap of the in-flight span; appends wait beyond it
    node_id: int = 0
    node_epoch: int = 0
    sync_mode: str = "dsync"                # "dsync" (O_DSYNC), "fdatasync" (per block), "none"
    max_record_size: int = 128 << 20        # largest body accepted by append()
    append_timeout_s: float = 30.0          # how long a blocking append() waits for window room
    max_buffered_bytes: int = 32 << 20      # appends wait while this much is not yet durable
    buffer_pool_bytes: int = 64 << 20       # aligned block buffers kept for reuse
    # IO threads need the GIL for a few microseconds after each write; with CPython's default
    # 5 ms switch interval a busy event loop delays every acknowledgement by up to 5 ms. open()
    # lowers the process-wide interval to this value (never raises it); None leaves it alone.
    gil_switch_interval_s: float | None = 0.0005
    # format a file/device that holds data which is not an s3kafka WAL (erasing it); without
    # it such a path is refused. Blank (all-zero) space and new files are formatted anyway.
    allow_format: bool = False
    # a WAL whose header says another node took it over (takeover done) is refused at open;
    # with this set, and a node_epoch above the one recorded in it, open() formats it afresh
    # instead (its records are committed elsewhere). A takeover still in progress is refused
    # in any case. See docs/wal.md "Takeover and fencing".
    reformat_taken_over: bool = False

    def validate(self) -> None:
        """Reject settings that would make the on-disk format or recovery unsound."""
        if self.capacity % 4096 or self.capacity < 4 * 4096:
            raise ValueError("wal capacity must be a multiple of 4096 and at least 16 KiB")
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(f"sync_mode must be one of {SYNC_MODES}")
        if self.io_engine not in IO_ENGINES:
            raise ValueError(f"io_engine must be one of {', '.join(IO_ENGINES)}")
        if self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")
        if self.eager_writes < 1:
            raise ValueError("eager_writes must be >= 1")
        if self.block_soft_limit < 4096:
            raise ValueError("block_soft_limit must be >= 4096")
        if self.window_initial < 0 or self.window_max < self.window_initial:
            raise ValueError("need 0 <= window_initial <= window_max")
        if self.flush_interval_s < 0:
            raise ValueError("flush_interval_s must be >= 0")
        if self.backlog_write_bytes < self.max_write_bytes:
            raise ValueError("backlog_write_bytes must be >= max_write_bytes")
        if self.bandwidth_limit is not None and self.bandwidth_limit <= 0:
            raise ValueError("bandwidth_limit must be positive or None")
