import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.Future;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.ListOffsetsOptions;
import org.apache.kafka.clients.admin.ListOffsetsResult.ListOffsetsResultInfo;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.clients.admin.OffsetSpec;
import org.apache.kafka.clients.admin.RecordsToDelete;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.OffsetOutOfRangeException;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.IsolationLevel;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.internals.RecordHeader;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Makes the Kafka client calls that Spark's spark-sql-kafka-0-10 connector makes, with the same
 * configs, against a broker: the driver's AdminClient (describeTopics, listTopics, listOffsets
 * earliest/latest/forTimestamp under the configured isolation level), the executors' consumer
 * (assign, seekToBeginning/End + position for the available range, seek + poll to fetch, auto
 * commit off, unique group id, auto.offset.reset none) and the sink's producer (byte arrays,
 * records with headers, flush). The connector itself cannot be downloaded on these machines.
 *
 * Usage: SparkConnectorCalls BOOTSTRAP TOPIC [transactions]. Prints "OK name" per check, or
 * "FAIL name: why" and exits 1 at the first failed check; in transactions mode, exits 3 with
 * "UNSUPPORTED ..." when the broker lacks the transaction APIs.
 */
public final class SparkConnectorCalls {
    static final int PARTITIONS = 3;
    static final int PER_PARTITION = 20;
    static final long T0 = 1_767_225_600_000L; // record timestamps T0 + i * 1000 in each partition
    static final long POLL_MS = 15_000; // Spark: kafkaConsumer.pollTimeoutMs (default spark.network.timeout)

    static void check(String name, boolean ok, String detail) {
        if (ok) {
            System.out.println("OK " + name);
        } else {
            System.out.println("FAIL " + name + ": " + detail);
            System.out.flush();
            System.exit(1);
        }
    }

    /** Spark's kafkaParamsForDriver on top of the user's kafka.* options. */
    static Map<String, Object> driverParams(String bootstrap, String isolation) {
        Map<String, Object> p = new HashMap<>();
        p.put("bootstrap.servers", bootstrap);
        p.put("key.deserializer", ByteArrayDeserializer.class.getName());
        p.put("value.deserializer", ByteArrayDeserializer.class.getName());
        p.put("auto.offset.reset", "earliest");
        p.put("enable.auto.commit", "false");
        p.put("max.poll.records", "1");
        p.put("receive.buffer.bytes", "65536");
        if (isolation != null) p.put("isolation.level", isolation);
        return p;
    }

    /** Spark's kafkaParamsForExecutors: a unique group id per query, no commits, no reset. */
    static Map<String, Object> executorParams(String bootstrap, String isolation) {
        Map<String, Object> p = new HashMap<>();
        p.put("bootstrap.servers", bootstrap);
        p.put("key.deserializer", ByteArrayDeserializer.class.getName());
        p.put("value.deserializer", ByteArrayDeserializer.class.getName());
        p.put("auto.offset.reset", "none");
        p.put("group.id", "spark-kafka-source-" + UUID.randomUUID() + "-" + "/ckpt/sources/0".hashCode() + "-executor");
        p.put("enable.auto.commit", "false");
        p.put("receive.buffer.bytes", "65536");
        if (isolation != null) p.put("isolation.level", isolation);
        return p;
    }

    /** Spark's kafkaParamsForProducer. */
    static Map<String, Object> producerParams(String bootstrap) {
        Map<String, Object> p = new HashMap<>();
        p.put("bootstrap.servers", bootstrap);
        p.put("key.serializer", ByteArraySerializer.class.getName());
        p.put("value.serializer", ByteArraySerializer.class.getName());
        return p;
    }

    static byte[] b(String s) {
        return s.getBytes(StandardCharsets.UTF_8);
    }

    static String s(byte[] b) {
        return b == null ? null : new String(b, StandardCharsets.UTF_8);
    }

    static Map<TopicPartition, Long> listOffsets(Admin admin, List<TopicPartition> tps, OffsetSpec spec,
                                                 IsolationLevel level) throws Exception {
        Map<TopicPartition, OffsetSpec> req = new HashMap<>();
        for (TopicPartition tp : tps) req.put(tp, spec);
        Map<TopicPartition, ListOffsetsResultInfo> res =
            admin.listOffsets(req, new ListOffsetsOptions(level)).all().get();
        Map<TopicPartition, Long> out = new HashMap<>();
        res.forEach((tp, info) -> out.put(tp, info.offset()));
        return out;
    }

    /** InternalKafkaConsumer.getAvailableOffsetRange. */
    static long[] availableRange(KafkaConsumer<byte[], byte[]> c, TopicPartition tp) {
        c.seekToBeginning(Set.of(tp));
        long earliest = c.position(tp);
        c.seekToEnd(Set.of(tp));
        long latest = c.position(tp);
        return new long[] {earliest, latest};
    }

    /** KafkaDataConsumer.get over [from, until): seek when not positioned, poll, check offsets. */
    static List<ConsumerRecord<byte[], byte[]>> fetchRange(KafkaConsumer<byte[], byte[]> c, TopicPartition tp,
                                                           long from, long until) {
        List<ConsumerRecord<byte[], byte[]>> out = new ArrayList<>();
        long next = from;
        long expectedPosition = -1;
        int emptyPolls = 0;
        while (next < until) {
            if (expectedPosition != next) c.seek(tp, next);
            ConsumerRecords<byte[], byte[]> polled = c.poll(Duration.ofMillis(POLL_MS));
            List<ConsumerRecord<byte[], byte[]>> recs = polled.records(tp);
            long positionAfter = c.position(tp);
            if (recs.isEmpty()) {
                check("poll returned records for " + tp + " at " + next, ++emptyPolls < 2,
                      "empty poll with position " + positionAfter + " below until " + until);
                expectedPosition = -1;
                continue;
            }
            for (ConsumerRecord<byte[], byte[]> r : recs) {
                if (r.offset() < next) continue; // a batch may start before the requested offset
                if (r.offset() >= until) break;
                check("record offset " + tp + "@" + next, r.offset() == next,
                      "got offset " + r.offset());
                out.add(r);
                next++;
            }
            expectedPosition = positionAfter;
        }
        return out;
    }

    public static void main(String[] args) {
        try {
            run(args);
        } catch (Throwable t) {
            Throwable cause = t.getCause() != null ? t.getCause() : t;
            // a broker without transactions: the transaction APIs unadvertised, or (s3kafka)
            // transactional producers refused at once with TRANSACTIONAL_ID_AUTHORIZATION_FAILED
            if (args.length > 2 && (cause instanceof org.apache.kafka.common.errors.UnsupportedVersionException
                    || cause instanceof org.apache.kafka.common.errors.TransactionalIdAuthorizationException)) {
                System.out.println("UNSUPPORTED " + cause.getMessage());
                System.exit(3);
            }
            System.out.println("FAIL exception after the last OK check: " + t);
            t.printStackTrace(System.out);
            System.out.flush();
            System.exit(1);
        }
    }

    static void run(String[] args) throws Exception {
        String bootstrap = args[0];
        String topic = args[1];
        boolean transactions = args.length > 2 && args[2].equals("transactions");
        List<TopicPartition> tps = new ArrayList<>();
        for (int p = 0; p < PARTITIONS; p++) tps.add(new TopicPartition(topic, p));

        try (Admin admin = Admin.create(driverParams(bootstrap, null))) {
            admin.createTopics(List.of(new NewTopic(topic, PARTITIONS, (short) 1))).all().get();
            check("createTopics", true, "");
        }
        if (transactions) {
            transactional(bootstrap, topic, tps);
            return;
        }

        // --- the sink's producer: byte arrays, headers, explicit timestamps per record ---
        List<Future<RecordMetadata>> sent = new ArrayList<>();
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(producerParams(bootstrap))) {
            for (int i = 0; i < PER_PARTITION; i++) {
                for (int p = 0; p < PARTITIONS; p++) {
                    List<Header> headers = List.of(new RecordHeader("h", b("p" + p + "-" + i)));
                    sent.add(producer.send(new ProducerRecord<>(topic, p, T0 + i * 1000L, b("k" + p + "-" + i),
                                                                b("v" + p + "-" + i), headers)));
                }
            }
            producer.flush();
        }
        for (int n = 0; n < sent.size(); n++) {
            RecordMetadata md = sent.get(n).get();
            int i = n / PARTITIONS;
            check("produce ack " + md.topic() + "-" + md.partition() + "@" + md.offset(), md.offset() == i,
                  "expected offset " + i);
        }

        // --- the driver: AdminClient calls of KafkaOffsetReaderAdmin under both isolation levels ---
        for (IsolationLevel level : IsolationLevel.values()) {
            String iso = level.toString().toLowerCase(Locale.ROOT);
            try (Admin admin = Admin.create(driverParams(bootstrap, iso))) {
                Map<String, TopicDescription> desc = admin.describeTopics(List.of(topic)).allTopicNames().get();
                check("describeTopics " + iso, desc.get(topic).partitions().size() == PARTITIONS,
                      String.valueOf(desc));
                Set<String> names = admin.listTopics().names().get();
                check("listTopics " + iso, names.contains(topic), String.valueOf(names));
                Map<TopicPartition, Long> earliest = listOffsets(admin, tps, OffsetSpec.earliest(), level);
                Map<TopicPartition, Long> latest = listOffsets(admin, tps, OffsetSpec.latest(), level);
                for (TopicPartition tp : tps) {
                    check("listOffsets earliest " + iso + " " + tp, earliest.get(tp) == 0L, "" + earliest.get(tp));
                    check("listOffsets latest " + iso + " " + tp, latest.get(tp) == PER_PARTITION,
                          "" + latest.get(tp));
                }
                long[][] cases = {
                    {T0 - 5000, 0}, {T0, 0}, {T0 + 7000, 7}, {T0 + 7500, 8},
                    {T0 + (PER_PARTITION - 1) * 1000L, PER_PARTITION - 1},
                    {T0 + PER_PARTITION * 1000L, -1} // no match: Spark maps -1 to latest / error
                };
                for (long[] c : cases) {
                    Map<TopicPartition, Long> byTs = listOffsets(admin, tps, OffsetSpec.forTimestamp(c[0]), level);
                    for (TopicPartition tp : tps) {
                        check("listOffsets forTimestamp T0" + (c[0] >= T0 ? "+" : "") + (c[0] - T0) + " " + iso
                              + " " + tp, byTs.get(tp) == c[1], "expected " + c[1] + " got " + byTs.get(tp));
                    }
                }
            }
        }

        // --- the executors: one consumer per task, assign + seek + poll ---
        for (IsolationLevel level : IsolationLevel.values()) {
            String iso = level.toString().toLowerCase(Locale.ROOT);
            for (TopicPartition tp : tps) {
                try (KafkaConsumer<byte[], byte[]> c = new KafkaConsumer<>(executorParams(bootstrap, iso))) {
                    c.assign(Collections.singleton(tp));
                    long[] range = availableRange(c, tp);
                    check("available range " + iso + " " + tp, range[0] == 0 && range[1] == PER_PARTITION,
                          Arrays.toString(range));
                    // Spark splits [0, 20) into tasks; read a middle slice and then the whole range
                    List<ConsumerRecord<byte[], byte[]>> slice = fetchRange(c, tp, 5, 12);
                    check("fetch slice " + iso + " " + tp, slice.size() == 7, "got " + slice.size());
                    List<ConsumerRecord<byte[], byte[]>> all = fetchRange(c, tp, 0, PER_PARTITION);
                    for (ConsumerRecord<byte[], byte[]> r : all) {
                        int i = (int) r.offset();
                        String want = tp.partition() + "-" + i;
                        Header h = r.headers().lastHeader("h");
                        boolean ok = ("k" + want).equals(s(r.key())) && ("v" + want).equals(s(r.value()))
                            && r.timestamp() == T0 + i * 1000L && h != null && ("p" + want).equals(s(h.value()));
                        check("record content " + iso + " " + tp + "@" + i, ok,
                              s(r.key()) + "=" + s(r.value()) + " ts=" + r.timestamp() + " h=" + h);
                    }
                    check("fetch all " + iso + " " + tp, all.size() == PER_PARTITION, "got " + all.size());
                    // an offset past the end (data loss / wrong checkpoint): reset none must throw
                    c.seek(tp, PER_PARTITION + 100);
                    boolean threw = false;
                    try {
                        c.poll(Duration.ofMillis(POLL_MS));
                    } catch (OffsetOutOfRangeException e) {
                        threw = true;
                    }
                    check("out of range with auto.offset.reset=none " + iso + " " + tp, threw,
                          "poll did not throw OffsetOutOfRangeException");
                }
            }
        }
        // --- retention trimmed the log (DeleteRecords): Spark's data-loss detection relies on this ---
        TopicPartition trimmed = tps.get(0);
        try (Admin admin = Admin.create(driverParams(bootstrap, null))) {
            admin.deleteRecords(Map.of(trimmed, RecordsToDelete.beforeOffset(5))).all().get();
            long low = 5;
            for (IsolationLevel level : IsolationLevel.values()) {
                long earliest = listOffsets(admin, List.of(trimmed), OffsetSpec.earliest(), level).get(trimmed);
                check("earliest after deleteRecords " + level, earliest == low, "got " + earliest);
            }
        }
        try (KafkaConsumer<byte[], byte[]> c = new KafkaConsumer<>(executorParams(bootstrap, null))) {
            c.assign(Collections.singleton(trimmed));
            long[] range = availableRange(c, trimmed);
            check("available range after deleteRecords", range[0] == 5 && range[1] == PER_PARTITION,
                  Arrays.toString(range));
            c.seek(trimmed, 2);
            boolean threw = false;
            try {
                c.poll(Duration.ofMillis(POLL_MS));
            } catch (OffsetOutOfRangeException e) {
                threw = true;
            }
            check("fetch below log start with auto.offset.reset=none throws", threw, "no exception");
            check("fetch from log start after deleteRecords", fetchRange(c, trimmed, 5, PER_PARTITION).size() == 15,
                  "");
        }
        System.out.println("DONE");
    }

    /** Open transaction: read_committed latest = LSO, read_uncommitted latest = HW; commit moves both. */
    static void transactional(String bootstrap, String topic, List<TopicPartition> tps) throws Exception {
        TopicPartition tp = tps.get(0);
        Map<String, Object> plain = producerParams(bootstrap);
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(plain)) {
            for (int i = 0; i < 5; i++) producer.send(new ProducerRecord<>(topic, 0, b("k" + i), b("v" + i))).get();
        }
        Map<String, Object> txp = producerParams(bootstrap);
        txp.put("transactional.id", "spark-repro-" + UUID.randomUUID());
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(txp);
             Admin admin = Admin.create(driverParams(bootstrap, null))) {
            producer.initTransactions();
            producer.beginTransaction();
            List<Future<RecordMetadata>> txSent = new ArrayList<>();
            for (int i = 0; i < 3; i++) txSent.add(producer.send(new ProducerRecord<>(topic, 0, b("t" + i), b("tv" + i))));
            producer.flush();
            for (Future<RecordMetadata> f : txSent) {
                long off = f.get().offset();
                check("transactional produce ack @" + off, off >= 5 && off < 8, "offset " + off);
            }
            long hw = listOffsets(admin, tps, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED).get(tp);
            long lso = listOffsets(admin, tps, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED).get(tp);
            check("open txn: read_uncommitted latest = high watermark", hw == 8, "got " + hw);
            check("open txn: read_committed latest = last stable offset", lso == 5, "got " + lso);
            try (KafkaConsumer<byte[], byte[]> c = new KafkaConsumer<>(executorParams(bootstrap, "read_committed"))) {
                c.assign(Collections.singleton(tp));
                long[] range = availableRange(c, tp);
                check("open txn: read_committed consumer range", range[0] == 0 && range[1] == 5,
                      Arrays.toString(range));
                check("open txn: read_committed fetch", fetchRange(c, tp, 0, 5).size() == 5, "");
            }
            producer.commitTransaction();
            long lso2 = listOffsets(admin, tps, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED).get(tp);
            // 5 plain + 3 transactional + 1 commit marker
            check("committed txn: read_committed latest", lso2 == 9, "got " + lso2);
            try (KafkaConsumer<byte[], byte[]> c = new KafkaConsumer<>(executorParams(bootstrap, "read_committed"))) {
                c.assign(Collections.singleton(tp));
                c.seek(tp, 0);
                List<ConsumerRecord<byte[], byte[]>> got = new ArrayList<>();
                while (c.position(tp) < lso2) {
                    ConsumerRecords<byte[], byte[]> recs = c.poll(Duration.ofMillis(POLL_MS));
                    if (recs.isEmpty()) break;
                    got.addAll(recs.records(tp));
                }
                // Spark tolerates the gap of the control record (offset 8) in read_committed
                check("committed txn: read_committed records", got.size() == 8 && c.position(tp) == 9,
                      "got " + got.size() + " records, position " + c.position(tp));
            }
        }
        System.out.println("DONE");
    }
}
