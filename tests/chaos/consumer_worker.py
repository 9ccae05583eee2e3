"""A consumer that records each value durably, then commits (used by the chaos tests).

    python consumer_worker.py BOOTSTRAP TOPIC GROUP OUTFILE

Appends one line per record to OUTFILE (fsynced), commits after every
batch, and runs until killed.
"""

import asyncio
import os
import sys

from conveyor.config import KafkaTransportConfig
from conveyor.transport.kafka import KafkaTransport


async def main(bootstrap: str, topic: str, group: str, outfile: str) -> None:
    transport = KafkaTransport(
        KafkaTransportConfig(bootstrap_servers=bootstrap, session_timeout_ms=6000, heartbeat_interval_ms=500)
    )
    consumer = transport.consumer([topic], group)
    await consumer.start()
    with open(outfile, "a") as out:
        while True:
            for record in await consumer.getmany(timeout_s=0.5, max_records=5):
                out.write(record.value.decode() + "\n")
                out.flush()
                os.fsync(out.fileno())
                await asyncio.sleep(0.02)  # some work per record
            await consumer.commit()  # after the work is durable


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
