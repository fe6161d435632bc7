import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicBoolean;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.errors.RetriableException;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * The chaos workload's Java writer: an idempotent acks=all kafka-clients producer sending the
 * unique values "<name>|<n, 9 digits>|" + 500 dots to partition n % partitions at a steady rate
 * until its stdin closes (or reads "stop"), then flushing. Every answer goes to stdout, one line
 * each: "S n partition" when sent, "A n partition offset" when acknowledged, "E n class retriable"
 * when failed. Usage: ChaosWriter bootstrap topic partitions name rate-per-second
 */
public final class ChaosWriter {
    private ChaosWriter() {}

    public static void main(String[] a) throws Exception {
        String bootstrap = a[0], topic = a[1], name = a[3];
        int partitions = Integer.parseInt(a[2]);
        double rate = Double.parseDouble(a[4]);
        Properties p = new Properties();
        p.put("bootstrap.servers", bootstrap);
        p.put("client.id", "chaos-" + name);
        p.put("acks", "all");
        p.put("enable.idempotence", "true");
        p.put("linger.ms", "5");
        p.put("delivery.timeout.ms", "120000");
        p.put("request.timeout.ms", "20000");
        p.put("retry.backoff.ms", "100");
        p.put("reconnect.backoff.max.ms", "500");
        p.put("metadata.max.age.ms", "2000");
        p.put("max.block.ms", "60000");
        p.put("key.serializer", ByteArraySerializer.class.getName());
        p.put("value.serializer", ByteArraySerializer.class.getName());
        PrintStream out = new PrintStream(System.out, false, "UTF-8");
        AtomicBoolean stop = new AtomicBoolean(false);
        Thread stdin = new Thread(() -> {
            try (BufferedReader r = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
                String line;
                while ((line = r.readLine()) != null && !line.trim().equals("stop")) { }
            } catch (Exception e) { }
            stop.set(true);
        });
        stdin.setDaemon(true);
        stdin.start();
        String pad = ".".repeat(500);
        long intervalNs = (long) (1e9 / rate);
        long next = System.nanoTime();
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(p)) {
            for (long n = 0; !stop.get(); n++) {
                final long seq = n;
                final int part = (int) (n % partitions);
                byte[] v = String.format("%s|%09d|%s", name, n, pad).getBytes(StandardCharsets.UTF_8);
                synchronized (out) { out.println("S " + seq + " " + part); }
                producer.send(new ProducerRecord<>(topic, part, null, v), (md, e) -> {
                    synchronized (out) {
                        if (e == null) {
                            out.println("A " + seq + " " + md.partition() + " " + md.offset());
                        } else {
                            out.println("E " + seq + " " + e.getClass().getSimpleName() + " "
                                        + (e instanceof RetriableException));
                        }
                    }
                });
                next += intervalNs;
                long sleep = next - System.nanoTime();
                if (sleep > 0) {
                    Thread.sleep(sleep / 1_000_000, (int) (sleep % 1_000_000));
                } else {
                    next = System.nanoTime();
                }
                if (seq % 50 == 0) synchronized (out) { out.flush(); }
            }
            producer.flush();
        }
        synchronized (out) { out.println("DONE"); out.flush(); }
    }
}
