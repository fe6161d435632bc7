import java.time.Duration;
import java.util.*;
import java.util.concurrent.*;
import java.util.concurrent.atomic.AtomicBoolean;

import org.apache.kafka.clients.admin.*;
import org.apache.kafka.clients.consumer.*;
import org.apache.kafka.clients.producer.*;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.config.ConfigResource;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Drives unmodified Java kafka-clients against a broker for the pytest end-to-end suite.
 * Compiles against kafka-clients 3.9 and 4.x alike (only APIs present in both are used).
 * Usage: KafkaCli <command> --bootstrap host:port [--key value ...]; prints one JSON object.
 * Commands: produce, produce-matrix, consume-assign, consume-group, group-rebalance, admin,
 * answers (Kafka's answers clients depend on: one JVM, one JSON object of outcomes),
 * txn (transactions: consume-transform-produce with sendOffsetsToTransaction, commit, abort,
 * a second instance fencing the first; one JVM, one JSON object of outcomes).
 */
public final class KafkaCli {
    private KafkaCli() {}

    public static void main(String[] argv) throws Exception {
        if (argv.length < 1) {
            throw new IllegalArgumentException("usage: KafkaCli <command> [--opt value ...]");
        }
        Map<String, String> a = new HashMap<>();
        for (int i = 1; i + 1 < argv.length; i += 2) {
            a.put(argv[i].replaceFirst("^--", ""), argv[i + 1]);
        }
        Map<String, Object> out;
        switch (argv[0]) {
            case "produce": out = produce(a); break;
            case "produce-matrix": out = produceMatrix(a); break;
            case "consume-assign": out = consumeAssign(a); break;
            case "consume-group": out = consumeGroup(a); break;
            case "group-rebalance": out = groupRebalance(a); break;
            case "admin": out = admin(a); break;
            case "answers": out = answers(a); break;
            case "txn": out = txn(a); break;
            case "txn-die": txnDie(a); return;
            case "txn-epochs": out = txnEpochs(a); break;
            default: throw new IllegalArgumentException("unknown command " + argv[0]);
        }
        System.out.println(Json.write(out));
        System.out.flush();
        System.exit(0);
    }

    static String req(Map<String, String> a, String k) {
        String v = a.get(k);
        if (v == null) throw new IllegalArgumentException("missing --" + k);
        return v;
    }

    static Properties common(Map<String, String> a) {
        Properties p = new Properties();
        p.put("bootstrap.servers", req(a, "bootstrap"));
        p.put("client.id", a.getOrDefault("client-id", "s3kafka-java-test"));
        p.put("request.timeout.ms", "15000");
        p.put("default.api.timeout.ms", "30000");
        return p;
    }

    // ---------------------------------------------------------------- producer
    static Properties producerProps(Map<String, String> a) {
        Properties p = common(a);
        String acks = a.getOrDefault("acks", "all");
        p.put("acks", acks);
        p.put("compression.type", a.getOrDefault("compression", "none"));
        // idempotence needs acks=all; the Java client refuses an explicit conflict
        p.put("enable.idempotence", Boolean.toString(acks.equals("all") || acks.equals("-1")));
        p.put("linger.ms", a.getOrDefault("linger-ms", "5"));
        p.put("delivery.timeout.ms", a.getOrDefault("delivery-timeout-ms", "30000"));
        p.put("max.block.ms", "15000");
        p.put("key.serializer", StringSerializer.class.getName());
        p.put("value.serializer", StringSerializer.class.getName());
        return p;
    }

    /** Sends --count records "<prefix>-<i>" and reports what was acknowledged. */
    static Map<String, Object> produce(Map<String, String> a) throws Exception {
        String topic = req(a, "topic");
        int count = Integer.parseInt(a.getOrDefault("count", "100"));
        String prefix = a.getOrDefault("prefix", "v");
        Integer partition = a.containsKey("partition") ? Integer.valueOf(a.get("partition")) : null;
        long paceMs = Long.parseLong(a.getOrDefault("pace-ms", "0"));   // sleep per 10 records
        List<Future<RecordMetadata>> futures = new ArrayList<>();
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(producerProps(a))) {
            for (int i = 0; i < count; i++) {
                String v = prefix + "-" + i;
                if (paceMs > 0 && i % 10 == 0) Thread.sleep(paceMs);
                Future<RecordMetadata> f = producer.send(new ProducerRecord<>(topic, partition, "k" + i, v));
                futures.add(f);
                if (f.isDone()) {
                    // a send that failed synchronously (no metadata) would fail for every record:
                    // stop instead of blocking max.block.ms per record
                    try { f.get(); } catch (ExecutionException e) { break; }
                }
            }
            producer.flush();
        }
        int acked = 0;
        List<String> errors = new ArrayList<>();
        Map<String, List<Long>> offsets = new TreeMap<>();
        for (Future<RecordMetadata> f : futures) {
            try {
                RecordMetadata m = f.get();
                acked++;
                offsets.computeIfAbsent(Integer.toString(m.partition()), k -> new ArrayList<>())
                        .add(m.hasOffset() ? m.offset() : -1L);
            } catch (ExecutionException e) {
                errors.add(e.getCause().toString());
            }
        }
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("acked", acked);
        out.put("errors", errors);
        out.put("offsets", offsets);
        return out;
    }

    /** produce for every --acks x --compressions pair (comma lists), prefix "<acks>-<codec>". */
    static Map<String, Object> produceMatrix(Map<String, String> a) throws Exception {
        Map<String, Object> out = new LinkedHashMap<>();
        for (String acks : a.getOrDefault("acks", "0,1,all").split(",")) {
            for (String codec : a.getOrDefault("compressions", "none,gzip,snappy,lz4,zstd").split(",")) {
                Map<String, String> one = new HashMap<>(a);
                one.put("acks", acks);
                one.put("compression", codec);
                one.put("prefix", acks + "-" + codec);
                out.put(acks + "-" + codec, produce(one));
            }
        }
        return out;
    }

    // ---------------------------------------------------------------- consumers
    static Properties consumerProps(Map<String, String> a, String group) {
        Properties p = common(a);
        if (group != null) p.put("group.id", group);
        p.put("enable.auto.commit", "false");
        p.put("auto.offset.reset", a.getOrDefault("reset", "earliest"));
        p.put("isolation.level", a.getOrDefault("isolation", "read_uncommitted"));
        p.put("session.timeout.ms", a.getOrDefault("session-timeout-ms", "6000"));
        p.put("heartbeat.interval.ms", "300");
        p.put("max.poll.interval.ms", "60000");
        p.put("fetch.max.wait.ms", "200");
        if (a.containsKey("client-rack")) p.put("client.rack", a.get("client-rack"));
        if (a.containsKey("assignor")) {
            String cls = a.get("assignor").equals("cooperative-sticky")
                    ? "org.apache.kafka.clients.consumer.CooperativeStickyAssignor"
                    : "org.apache.kafka.clients.consumer.RangeAssignor";
            p.put("partition.assignment.strategy", cls);
        }
        p.put("key.deserializer", StringDeserializer.class.getName());
        p.put("value.deserializer", StringDeserializer.class.getName());
        return p;
    }

    static Map<String, Object> rec(ConsumerRecord<String, String> r) {
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("p", r.partition());
        m.put("o", r.offset());
        m.put("k", r.key());
        m.put("v", r.value());
        m.put("e", r.leaderEpoch().orElse(-1));
        return m;
    }

    /** assign + seek (or seekToBeginning), poll until --count records or --timeout-ms. */
    static Map<String, Object> consumeAssign(Map<String, String> a) {
        String topic = req(a, "topic");
        int count = Integer.parseInt(a.getOrDefault("count", "1"));
        long deadline = System.currentTimeMillis() + Long.parseLong(a.getOrDefault("timeout-ms", "30000"));
        TopicPartition tp = new TopicPartition(topic, Integer.parseInt(a.getOrDefault("partition", "0")));
        List<Object> records = new ArrayList<>();
        Map<String, Object> out = new LinkedHashMap<>();
        try (KafkaConsumer<String, String> c = new KafkaConsumer<>(consumerProps(a, null))) {
            c.assign(List.of(tp));
            if (a.containsKey("offset")) c.seek(tp, Long.parseLong(a.get("offset")));
            else c.seekToBeginning(List.of(tp));
            while (records.size() < count && System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(200))) records.add(rec(r));
            }
            out.put("position", c.position(tp));
            out.put("end_offset", c.endOffsets(List.of(tp)).get(tp));
            out.put("beginning_offset", c.beginningOffsets(List.of(tp)).get(tp));
        }
        out.put("records", records);
        return out;
    }

    /** subscribe in --group, poll until --count distinct records (partition, offset; a re-read
     *  after a group change is reported but not counted) or the timeout, commitSync, close. */
    static Map<String, Object> consumeGroup(Map<String, String> a) {
        String topic = req(a, "topic");
        String group = req(a, "group");
        int count = Integer.parseInt(a.getOrDefault("count", "1"));
        long timeout = Long.parseLong(a.getOrDefault("timeout-ms", "30000"));
        long deadline = System.currentTimeMillis() + timeout;
        List<Object> records = new ArrayList<>();
        Set<String> distinct = new HashSet<>();
        Map<String, Object> out = new LinkedHashMap<>();
        try (KafkaConsumer<String, String> c = new KafkaConsumer<>(consumerProps(a, group))) {
            c.subscribe(List.of(topic));
            while (distinct.size() < count && System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(200))) {
                    records.add(rec(r));
                    distinct.add(r.partition() + ":" + r.offset());
                }
            }
            // after the goal, one more short poll proves nothing beyond it was pending
            for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(500))) records.add(rec(r));
            c.commitSync();
            Map<String, Object> committed = new TreeMap<>();
            for (Map.Entry<TopicPartition, OffsetAndMetadata> e : c.committed(c.assignment()).entrySet()) {
                committed.put(Integer.toString(e.getKey().partition()), e.getValue() == null ? null : e.getValue().offset());
            }
            out.put("committed", committed);
        }
        out.put("records", records);
        return out;
    }

    /**
     * Three members of --group in one JVM (one thread each): wait for a 3-way split of the
     * partitions, close member 3 (LeaveGroup), wait for the 2 survivors to cover every
     * partition, consume until --count distinct records, commit, report assignments.
     */
    static Map<String, Object> groupRebalance(Map<String, String> a) throws Exception {
        String topic = req(a, "topic");
        String group = req(a, "group");
        int partitions = Integer.parseInt(req(a, "partitions"));
        int count = Integer.parseInt(req(a, "count"));
        long deadline = System.currentTimeMillis() + Long.parseLong(a.getOrDefault("timeout-ms", "60000"));
        final int n = 3;
        List<Set<Integer>> assigned = new ArrayList<>();
        for (int i = 0; i < n; i++) assigned.add(ConcurrentHashMap.newKeySet());
        Set<String> seen = ConcurrentHashMap.newKeySet();
        AtomicBoolean[] stop = new AtomicBoolean[n];
        ExecutorService pool = Executors.newFixedThreadPool(n);
        List<Future<?>> tasks = new ArrayList<>();
        for (int i = 0; i < n; i++) {
            final int me = i;
            stop[i] = new AtomicBoolean(false);
            Map<String, String> mine = new HashMap<>(a);
            mine.put("client-id", "member-" + i);
            tasks.add(pool.submit(() -> {
                try (KafkaConsumer<String, String> c = new KafkaConsumer<>(consumerProps(mine, group))) {
                    c.subscribe(List.of(topic), new ConsumerRebalanceListener() {
                        public void onPartitionsRevoked(Collection<TopicPartition> ps) {
                            for (TopicPartition tp : ps) assigned.get(me).remove(tp.partition());
                        }
                        public void onPartitionsAssigned(Collection<TopicPartition> ps) {
                            for (TopicPartition tp : ps) assigned.get(me).add(tp.partition());
                        }
                    });
                    while (!stop[me].get()) {
                        for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(100))) seen.add(r.value());
                    }
                    // read the assigned partitions to their ends before the one commit: a member
                    // stopped right after an eager rebalance has its positions back at the
                    // committed offsets (none yet: the log start) and committed those
                    long until = System.currentTimeMillis() + 15000;
                    while (System.currentTimeMillis() < until) {
                        Set<TopicPartition> owned = c.assignment();
                        Map<TopicPartition, Long> ends = c.endOffsets(owned);
                        boolean caughtUp = true;
                        for (TopicPartition tp : owned) caughtUp &= c.position(tp) >= ends.get(tp);
                        if (caughtUp) break;
                        for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(100))) seen.add(r.value());
                    }
                    c.commitSync();
                }
                return null;
            }));
        }
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("phase1", waitSplit(assigned, List.of(0, 1, 2), partitions, deadline));
        stop[2].set(true);
        tasks.get(2).get(30, TimeUnit.SECONDS);
        assigned.get(2).clear();
        out.put("phase2", waitSplit(assigned, List.of(0, 1), partitions, deadline));
        while (seen.size() < count && System.currentTimeMillis() < deadline) Thread.sleep(50);
        // leave one at a time, each from a stable assignment (a commit racing an eager
        // rebalance would find nothing assigned and commit nothing)
        stop[0].set(true);
        tasks.get(0).get(30, TimeUnit.SECONDS);
        assigned.get(0).clear();
        waitSplit(assigned, List.of(1), partitions, deadline);
        stop[1].set(true);
        tasks.get(1).get(30, TimeUnit.SECONDS);
        pool.shutdown();
        out.put("distinct", seen.size());
        return out;
    }

    /** Waits until the given members own disjoint, non-empty sets covering every partition. */
    static List<List<Integer>> waitSplit(List<Set<Integer>> assigned, List<Integer> members,
                                         int partitions, long deadline) throws InterruptedException {
        while (System.currentTimeMillis() < deadline) {
            List<List<Integer>> snap = new ArrayList<>();
            Set<Integer> union = new HashSet<>();
            int total = 0;
            boolean nonEmpty = true;
            for (int m : members) {
                List<Integer> s = new ArrayList<>(assigned.get(m));
                Collections.sort(s);
                snap.add(s);
                union.addAll(s);
                total += s.size();
                nonEmpty &= !s.isEmpty();
            }
            if (nonEmpty && union.size() == partitions && total == partitions) return snap;
            Thread.sleep(50);
        }
        List<List<Integer>> snap = new ArrayList<>();
        for (int m : members) snap.add(new ArrayList<>(assigned.get(m)));
        throw new IllegalStateException("group never split the partitions: " + snap);
    }

    // ---------------------------------------------------------------- admin
    /** createTopics, describeTopics, listOffsets, deleteRecords, describeConfigs on --topic. */
    static Map<String, Object> admin(Map<String, String> a) throws Exception {
        String topic = req(a, "topic");
        int partitions = Integer.parseInt(a.getOrDefault("partitions", "2"));
        Map<String, Object> out = new LinkedHashMap<>();
        try (Admin admin = Admin.create(common(a))) {
            admin.createTopics(List.of(new NewTopic(topic, partitions, (short) 1)
                    .configs(Map.of("retention.ms", "3600000")))).all().get();
            try {
                admin.createTopics(List.of(new NewTopic(topic, partitions, (short) 1))).all().get();
                out.put("create_again", "ok");
            } catch (ExecutionException e) {
                out.put("create_again", e.getCause().getClass().getSimpleName());
            }
            out.put("listed", admin.listTopics().names().get().contains(topic));
            TopicDescription d = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic);
            out.put("describe_partitions", d.partitions().size());
            out.put("describe_leader", d.partitions().get(0).leader() == null ? -1 : d.partitions().get(0).leader().id());

            Map<String, String> pa = new HashMap<>(a);
            pa.put("count", "10");
            pa.put("partition", "0");
            pa.put("acks", "all");
            out.put("produce", produce(pa));

            TopicPartition tp0 = new TopicPartition(topic, 0);
            out.put("earliest", admin.listOffsets(Map.of(tp0, OffsetSpec.earliest())).all().get().get(tp0).offset());
            out.put("latest", admin.listOffsets(Map.of(tp0, OffsetSpec.latest())).all().get().get(tp0).offset());
            out.put("max_timestamp_offset",
                    admin.listOffsets(Map.of(tp0, OffsetSpec.maxTimestamp())).all().get().get(tp0).offset());
            out.put("for_timestamp_0",
                    admin.listOffsets(Map.of(tp0, OffsetSpec.forTimestamp(0L))).all().get().get(tp0).offset());

            out.put("low_watermark", admin.deleteRecords(Map.of(tp0, RecordsToDelete.beforeOffset(4L)))
                    .lowWatermarks().get(tp0).get().lowWatermark());
            out.put("earliest_after_delete",
                    admin.listOffsets(Map.of(tp0, OffsetSpec.earliest())).all().get().get(tp0).offset());

            ConfigResource res = new ConfigResource(ConfigResource.Type.TOPIC, topic);
            Config cfg = admin.describeConfigs(List.of(res)).all().get().get(res);
            Map<String, Object> cfgs = new TreeMap<>();
            for (ConfigEntry e : cfg.entries()) cfgs.put(e.name(), e.value());
            out.put("configs", cfgs);

            out.put("cluster_nodes", admin.describeCluster().nodes().get().size());
            admin.deleteTopics(List.of(topic)).all().get();
            out.put("listed_after_delete", admin.listTopics().names().get().contains(topic));
        }
        return out;
    }

    // ---------------------------------------------------------------- Kafka's answers
    /** The exception's class name (unwrapping ExecutionException), or "ok". */
    interface Step { Object run() throws Exception; }

    static Object outcome(Step s) {
        try {
            Object r = s.run();
            return r == null ? "ok" : r;
        } catch (ExecutionException e) {
            return e.getCause().getClass().getSimpleName();
        } catch (Exception e) {
            return e.getClass().getSimpleName();
        }
    }

    static List<String> ops(Set<org.apache.kafka.common.acl.AclOperation> s) {
        if (s == null) return null;
        List<String> out = new ArrayList<>();
        for (org.apache.kafka.common.acl.AclOperation o : s) out.add(o.name());
        Collections.sort(out);
        return out;
    }

    static Properties txnProducerProps(Map<String, String> a, String tid) {
        Properties p = producerProps(a);
        p.put("acks", "all");
        p.put("enable.idempotence", "true");
        p.put("transactional.id", tid);
        p.put("transaction.timeout.ms", a.getOrDefault("txn-timeout-ms", "60000"));
        return p;
    }

    /** Every value of ``topic`` a read_committed consumer gets (until --idle-ms without data). */
    static List<String> readCommitted(Map<String, String> a, String topic, int partitions) {
        Properties cp = consumerProps(a, null);
        cp.put("isolation.level", "read_committed");
        List<String> values = new ArrayList<>();
        try (KafkaConsumer<String, String> c = new KafkaConsumer<>(cp)) {
            List<TopicPartition> tps = new ArrayList<>();
            for (int i = 0; i < partitions; i++) tps.add(new TopicPartition(topic, i));
            c.assign(tps);
            c.seekToBeginning(tps);
            long idle = Long.parseLong(a.getOrDefault("idle-ms", "2000"));
            long last = System.currentTimeMillis();
            while (System.currentTimeMillis() - last < idle) {
                for (ConsumerRecord<String, String> r : c.poll(Duration.ofMillis(200))) {
                    values.add(r.value());
                    last = System.currentTimeMillis();
                }
            }
        }
        return values;
    }

    /**
     * Transactions (--topic: prefix of the topics it creates): (1) consume-transform-produce of
     * --count records in three transactions (commit, abort, redo + commit) with the consumer's
     * offsets sent to each transaction; (2) a second producer instance with the same
     * transactional id fences the first, whose commit then fails.
     */
    static Map<String, Object> txn(Map<String, String> a) throws Exception {
        String prefix = req(a, "topic");
        int count = Integer.parseInt(a.getOrDefault("count", "40"));
        String in = prefix + "-in", out = prefix + "-out", fence = prefix + "-fence";
        String group = prefix + "-ctp";
        Map<String, Object> res = new LinkedHashMap<>();
        try (Admin admin = Admin.create(common(a))) {
            admin.createTopics(List.of(new NewTopic(in, 2, (short) 1), new NewTopic(out, 2, (short) 1),
                    new NewTopic(fence, 1, (short) 1))).all().get();
        }
        try (KafkaProducer<String, String> pr = new KafkaProducer<>(producerProps(a))) {
            for (int i = 0; i < count; i++) pr.send(new ProducerRecord<>(in, i % 2, "k" + i, "in-" + i));
            pr.flush();
        }
        // (1) consume-transform-produce
        Properties cp = consumerProps(a, group);
        cp.put("isolation.level", "read_committed");
        cp.put("max.poll.records", Integer.toString(Math.max(1, count / 4)));
        List<String> outcomes = new ArrayList<>();
        try (KafkaConsumer<String, String> c = new KafkaConsumer<>(cp);
             KafkaProducer<String, String> p = new KafkaProducer<>(txnProducerProps(a, prefix + "-ctp-tid"))) {
            p.initTransactions();
            c.subscribe(List.of(in));
            int txns = 0, done = 0;
            long deadline = System.currentTimeMillis() + 60000;
            while (done < count && System.currentTimeMillis() < deadline) {
                ConsumerRecords<String, String> recs = c.poll(Duration.ofMillis(300));
                if (recs.isEmpty()) continue;
                p.beginTransaction();
                Map<TopicPartition, OffsetAndMetadata> offsets = new HashMap<>();
                for (ConsumerRecord<String, String> r : recs) {
                    p.send(new ProducerRecord<>(out, r.partition(), r.key(), r.value().replace("in-", "out-")));
                    offsets.put(new TopicPartition(r.topic(), r.partition()), new OffsetAndMetadata(r.offset() + 1));
                }
                p.sendOffsetsToTransaction(offsets, c.groupMetadata());
                txns++;
                if (txns == 2) {
                    p.abortTransaction();
                    outcomes.add("abort");
                    // reprocess: back to the last committed offsets of the group
                    Map<TopicPartition, OffsetAndMetadata> committed = c.committed(c.assignment());
                    for (TopicPartition tp : c.assignment()) {
                        OffsetAndMetadata om = committed.get(tp);
                        if (om != null) c.seek(tp, om.offset()); else c.seekToBeginning(List.of(tp));
                    }
                } else {
                    p.commitTransaction();
                    outcomes.add("commit");
                    done += recs.count();
                }
            }
            res.put("ctp_txns", outcomes);
        }
        try (Admin admin = Admin.create(common(a))) {
            long committedTotal = 0;
            for (Map.Entry<TopicPartition, OffsetAndMetadata> e : admin.listConsumerGroupOffsets(group)
                    .partitionsToOffsetAndMetadata().get().entrySet()) {
                committedTotal += e.getValue().offset();
            }
            res.put("ctp_group_offsets", committedTotal);
        }
        res.put("ctp_out", readCommitted(a, out, 2));
        // (2) fencing
        try (KafkaProducer<String, String> first = new KafkaProducer<>(txnProducerProps(a, prefix + "-fence-tid"))) {
            first.initTransactions();
            first.beginTransaction();
            first.send(new ProducerRecord<>(fence, 0, "z", "zombie")).get();
            try (KafkaProducer<String, String> second = new KafkaProducer<>(txnProducerProps(a, prefix + "-fence-tid"))) {
                second.initTransactions();
                second.beginTransaction();
                second.send(new ProducerRecord<>(fence, 0, "s", "second")).get();
                second.commitTransaction();
            }
            res.put("zombie_commit", outcome(() -> { first.commitTransaction(); return null; }));
        }
        // (3) Admin's view of an open transaction: describeTransactions, listTransactions,
        // describeProducers (its current transaction's first offset)
        String dtid = prefix + "-desc-tid";
        TopicPartition ftp = new TopicPartition(fence, 0);
        try (KafkaProducer<String, String> open = new KafkaProducer<>(txnProducerProps(a, dtid));
             Admin admin = Admin.create(common(a))) {
            open.initTransactions();
            open.beginTransaction();
            long first = open.send(new ProducerRecord<>(fence, 0, "d", "described")).get().offset();
            TransactionDescription d = admin.describeTransactions(List.of(dtid)).description(dtid).get();
            res.put("describe_state", d.state().toString());
            res.put("describe_partitions", d.topicPartitions().toString());
            res.put("list_has", admin.listTransactions().all().get().stream()
                    .anyMatch(l -> l.transactionalId().equals(dtid) && l.producerId() == d.producerId()));
            long start = -2;
            for (ProducerState ps : admin.describeProducers(List.of(ftp)).partitionResult(ftp).get().activeProducers()) {
                if (ps.producerId() == d.producerId()) start = ps.currentTransactionStartOffset().orElse(-1L);
            }
            res.put("producer_txn_start_matches", start == first);
            // read_committed: the end offset is the LSO (the open transaction's first offset),
            // read_uncommitted: the high watermark past it
            Properties rc = consumerProps(a, null);
            rc.put("isolation.level", "read_committed");
            try (KafkaConsumer<String, String> c = new KafkaConsumer<>(rc)) {
                res.put("lso_is_txn_start", c.endOffsets(List.of(ftp)).get(ftp) == first);
            }
            try (KafkaConsumer<String, String> c = new KafkaConsumer<>(consumerProps(a, null))) {
                res.put("hw_past_txn", c.endOffsets(List.of(ftp)).get(ftp) == first + 1);
            }
            open.abortTransaction();
        }
        res.put("fence_values", readCommitted(a, fence, 1));
        return res;
    }

    /**
     * A producer that dies in the middle of its transaction: begins one, sends --count records
     * to --topic (acknowledged), prints them and halts the JVM without ending it (as kill -9
     * would: no EndTxn, no close).
     */
    static void txnDie(Map<String, String> a) throws Exception {
        String topic = req(a, "topic");
        int count = Integer.parseInt(a.getOrDefault("count", "10"));
        KafkaProducer<String, String> p = new KafkaProducer<>(txnProducerProps(a, req(a, "tid")));
        p.initTransactions();
        p.beginTransaction();
        List<Long> offsets = new ArrayList<>();
        for (int i = 0; i < count; i++) {
            offsets.add(p.send(new ProducerRecord<>(topic, 0, "k" + i, "dying-" + i)).get().offset());
        }
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("offsets", offsets);
        System.out.println(Json.write(out));
        System.out.flush();
        Runtime.getRuntime().halt(0);
    }

    /**
     * The producer epoch after each of --count transactions of one producer (the second one
     * aborted), as Admin's describeTransactions reports it: KIP-890 part 2 clients (4.x, with
     * the broker's transaction.version 2) bump it on every transaction, 3.x clients never.
     */
    static Map<String, Object> txnEpochs(Map<String, String> a) throws Exception {
        String topic = req(a, "topic"), tid = req(a, "tid");
        int rounds = Integer.parseInt(a.getOrDefault("count", "3"));
        List<Integer> epochs = new ArrayList<>();
        List<String> states = new ArrayList<>();
        try (Admin admin = Admin.create(common(a));
             KafkaProducer<String, String> p = new KafkaProducer<>(txnProducerProps(a, tid))) {
            p.initTransactions();
            epochs.add((int) admin.describeTransactions(List.of(tid)).description(tid).get().producerEpoch());
            for (int i = 0; i < rounds; i++) {
                p.beginTransaction();
                p.send(new ProducerRecord<>(topic, 0, "k" + i, "v" + i)).get();
                if (i == 1) p.abortTransaction(); else p.commitTransaction();
                TransactionDescription d = admin.describeTransactions(List.of(tid)).description(tid).get();
                epochs.add((int) d.producerEpoch());
                states.add(d.state().toString());
            }
        }
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("epochs", epochs);
        out.put("states", states);
        out.put("committed", readCommitted(a, topic, 1));
        return out;
    }

    /** One outcome per answer of issue 18 (--topic: prefix of the topics it creates). */
    static Map<String, Object> answers(Map<String, String> a) throws Exception {
        String prefix = req(a, "topic");
        Map<String, Object> out = new LinkedHashMap<>();
        for (String[] t : new String[][] {{"txn", "60000"}, {"txn_timeout", "3600000"}}) {
            Properties p = producerProps(a);
            p.put("enable.idempotence", "true");
            p.put("acks", "all");
            p.put("transactional.id", prefix + "-" + t[0]);
            p.put("transaction.timeout.ms", t[1]);
            try (KafkaProducer<String, String> pr = new KafkaProducer<>(p)) {
                // the broker's answer only: the first producer's construction loads most of
                // kafka-clients' classes, seconds on a loaded machine
                long t0 = System.currentTimeMillis();
                out.put(t[0], outcome(() -> { pr.initTransactions(); return null; }));
                out.put(t[0] + "_ms", System.currentTimeMillis() - t0);
            }
        }
        String compacted = prefix + "-compacted";
        String group = prefix + "-group";
        try (Admin admin = Admin.create(common(a))) {
            admin.createTopics(List.of(new NewTopic(compacted, 1, (short) 1)
                    .configs(Map.of("cleanup.policy", "compact")))).all().get();
            Properties p = producerProps(a);
            try (KafkaProducer<String, String> pr = new KafkaProducer<>(p)) {
                out.put("compact_keyless", outcome(() -> { pr.send(new ProducerRecord<>(compacted, null, "v")).get(); return null; }));
                out.put("compact_keyed", outcome(() -> { pr.send(new ProducerRecord<>(compacted, "k", "v")).get(); return null; }));
                out.put("produce_internal", outcome(() -> { pr.send(new ProducerRecord<>("__consumer_offsets", "k", "v")).get(); return null; }));
            }
            out.put("create_consumer_offsets", outcome(() -> {
                admin.createTopics(List.of(new NewTopic("__consumer_offsets", 1, (short) 1))).all().get(); return null; }));
            out.put("create_transaction_state", outcome(() -> {
                admin.createTopics(List.of(new NewTopic("__transaction_state", 1, (short) 1))).all().get(); return null; }));
            out.put("list_internal", admin.listTopics(new ListTopicsOptions().listInternal(true)).names().get()
                    .contains("__consumer_offsets"));
            out.put("list_default", admin.listTopics().names().get().contains("__consumer_offsets"));

            out.put("cluster_ops", outcome(() -> ops(admin.describeCluster(
                    new DescribeClusterOptions().includeAuthorizedOperations(true)).authorizedOperations().get())));
            out.put("topic_ops", outcome(() -> ops(admin.describeTopics(List.of(compacted),
                    new DescribeTopicsOptions().includeAuthorizedOperations(true)).allTopicNames().get()
                    .get(compacted).authorizedOperations())));
            Properties cp = consumerProps(a, group);
            try (KafkaConsumer<String, String> c = new KafkaConsumer<>(cp)) {
                TopicPartition tp = new TopicPartition(compacted, 0);
                c.assign(List.of(tp));
                c.commitSync(Map.of(tp, new OffsetAndMetadata(0L)));
            }
            out.put("group_ops", outcome(() -> ops(admin.describeConsumerGroups(List.of(group),
                    new DescribeConsumerGroupsOptions().includeAuthorizedOperations(true)).all().get()
                    .get(group).authorizedOperations())));

            ConfigResource res = new ConfigResource(ConfigResource.Type.TOPIC, compacted);
            out.put("subtract_last", outcome(() -> {
                admin.incrementalAlterConfigs(Map.of(res, List.of(new AlterConfigOp(
                        new ConfigEntry("cleanup.policy", "compact"), AlterConfigOp.OpType.SUBTRACT)))).all().get();
                return "[" + admin.describeConfigs(List.of(res)).all().get().get(res).get("cleanup.policy").value() + "]";
            }));
            out.put("deprecated_configs", outcome(() -> {
                admin.incrementalAlterConfigs(Map.of(res, List.of(
                        new AlterConfigOp(new ConfigEntry("message.format.version", "3.0-IV1"), AlterConfigOp.OpType.SET),
                        new AlterConfigOp(new ConfigEntry("message.downconversion.enable", "false"), AlterConfigOp.OpType.SET),
                        new AlterConfigOp(new ConfigEntry("message.timestamp.difference.max.ms", "1000"), AlterConfigOp.OpType.SET))))
                        .all().get();
                Map<String, Object> m = new TreeMap<>();
                for (ConfigEntry e : admin.describeConfigs(List.of(res)).all().get().get(res).entries()) {
                    if (e.name().startsWith("message.")) m.put(e.name(), e.value() + "/" + e.source().name());
                }
                return m;
            }));
            out.put("log_dirs", outcome(() -> {
                Map<String, Object> m = new TreeMap<>();
                var dirs = admin.describeLogDirs(List.of(Integer.parseInt(a.getOrDefault("node", "0"))))
                        .allDescriptions().get();
                for (var node : dirs.values()) {
                    for (var d : node.entrySet()) {
                        for (var r : d.getValue().replicaInfos().entrySet()) {
                            if (r.getKey().topic().equals(compacted)) m.put(r.getKey().toString(), r.getValue().size());
                        }
                        m.put("dirs", node.size());
                    }
                }
                return m;
            }));
            admin.deleteTopics(List.of(compacted)).all().get();
        }
        return out;
    }

    // ---------------------------------------------------------------- tiny JSON writer
    static final class Json {
        static String write(Object o) {
            StringBuilder sb = new StringBuilder();
            write(sb, o);
            return sb.toString();
        }

        static void write(StringBuilder sb, Object o) {
            if (o == null) {
                sb.append("null");
            } else if (o instanceof Number || o instanceof Boolean) {
                sb.append(o);
            } else if (o instanceof Map) {
                sb.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : ((Map<?, ?>) o).entrySet()) {
                    if (!first) sb.append(',');
                    first = false;
                    write(sb, String.valueOf(e.getKey()));
                    sb.append(':');
                    write(sb, e.getValue());
                }
                sb.append('}');
            } else if (o instanceof Collection) {
                sb.append('[');
                boolean first = true;
                for (Object x : (Collection<?>) o) {
                    if (!first) sb.append(',');
                    first = false;
                    write(sb, x);
                }
                sb.append(']');
            } else {
                String s = o.toString();
                sb.append('"');
                for (char c : s.toCharArray()) {
                    if (c == '"' || c == '\\') sb.append('\\').append(c);
                    else if (c < 0x20) sb.append(String.format("\\u%04x", (int) c));
                    else sb.append(c);
                }
                sb.append('"');
            }
        }
    }
}
