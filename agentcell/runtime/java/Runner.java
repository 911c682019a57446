// A Java code context (kernel_java.py): one JVM running JShell in-process, its state kept between runs.
//
// Requests come on fd 3 as text lines (base64 fields: "R code k=v ..." runs code with those extra
// system properties, "E k=v ..." sets properties for every later run); answers go back on fd 3 in the
// agent framing (u32 header length, u32 payload length, JSON header, payload). Environment variables
// are system properties, as in E2B's Java kernel (IJava): System.getProperty("NAME"). The snippets'
// System.out / System.err are this JVM's fds 1 and 2, which the agent streams; System.in is empty.
import java.io.*;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.*;
import jdk.jshell.*;

public class Runner {
    static OutputStream ctrlOut;

    // System.out / System.err of the snippets: each line goes to the agent as one stdout/stderr line
    // without its newline, as E2B's Java kernel sends them; a partial line goes at the run's end.
    static class LineStream extends OutputStream {
        final String kind;
        final ByteArrayOutputStream buf = new ByteArrayOutputStream();

        LineStream(String kind) { this.kind = kind; }

        @Override public synchronized void write(int b) throws IOException {
            if (b == '\n') emit(); else buf.write(b);
            if (buf.size() >= 1 << 20) emit();  // a line without end is sent in pieces
        }

        @Override public synchronized void write(byte[] b, int off, int len) throws IOException {
            for (int i = off; i < off + len; i++) write(b[i]);
        }

        @Override public synchronized void flush() throws IOException { if (buf.size() > 0) emit(); }

        void emit() throws IOException {
            String text = buf.toString(StandardCharsets.UTF_8);
            buf.reset();
            frame("{\"line\":true}", "{\"type\":" + json(kind) + ",\"text\":" + json(text) + ",\"timestamp\":"
                    + json(java.time.OffsetDateTime.now(java.time.ZoneOffset.UTC).toString()) + "}");
        }
    }

    static int runs = 1;

    static FileDescriptor fd(int n) throws Exception {
        FileDescriptor d = new FileDescriptor();
        Field f = FileDescriptor.class.getDeclaredField("fd");
        f.setAccessible(true);
        f.setInt(d, n);
        return d;
    }

    static String json(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) b.append(String.format("\\u%04x", (int) c)); else b.append(c);
            }
        }
        return b.append('"').toString();
    }

    static synchronized void frame(String header, String payload) throws IOException {
        byte[] h = header.getBytes(StandardCharsets.UTF_8), p = payload.getBytes(StandardCharsets.UTF_8);
        ByteArrayOutputStream out = new ByteArrayOutputStream(8 + h.length + p.length);
        DataOutputStream d = new DataOutputStream(out);
        d.writeInt(h.length);
        d.writeInt(p.length);
        d.write(h);
        d.write(p);
        ctrlOut.write(out.toByteArray());
        ctrlOut.flush();
    }

    static void error(String name, String value, String traceback) throws IOException {
        frame("{\"line\":true}", "{\"type\":\"error\",\"name\":" + json(name) + ",\"value\":" + json(value)
                + ",\"traceback\":" + json(traceback) + "}");
    }

    // A String's value as jshell shows it is a Java literal: the text itself, as IJava shows it.
    static String unquote(String v) {
        if (v.length() < 2 || v.charAt(0) != '"' || v.charAt(v.length() - 1) != '"') return v;
        StringBuilder b = new StringBuilder();
        for (int i = 1; i < v.length() - 1; i++) {
            char c = v.charAt(i);
            if (c != '\\' || i + 1 >= v.length() - 1) { b.append(c); continue; }
            char n = v.charAt(++i);
            switch (n) {
                case 'n': b.append('\n'); break;
                case 't': b.append('\t'); break;
                case 'r': b.append('\r'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'u': b.append((char) Integer.parseInt(v.substring(i + 1, i + 5), 16)); i += 4; break;
                default: b.append(n);
            }
        }
        return b.toString();
    }

    static Map<String, String> pairs(String[] parts, int from) {
        Map<String, String> m = new LinkedHashMap<>();
        Base64.Decoder dec = Base64.getDecoder();
        for (int i = from; i < parts.length; i++) {
            int eq = parts[i].indexOf('=');
            if (eq < 0) continue;
            m.put(new String(dec.decode(parts[i].substring(0, eq)), StandardCharsets.UTF_8),
                  new String(dec.decode(parts[i].substring(eq + 1)), StandardCharsets.UTF_8));
        }
        return m;
    }

    static void run(JShell shell, String code) throws IOException {
        SourceCodeAnalysis sca = shell.sourceCodeAnalysis();
        String rest = code;
        String lastValue = null;
        boolean lastIsValue = false;
        while (!rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = sca.analyzeCompletion(rest);
            String src = info.source();
            if (src == null || info.completeness() == SourceCodeAnalysis.Completeness.DEFINITELY_INCOMPLETE) {
                error("CompilationException", "incomplete code: " + rest.strip(), rest);
                return;
            }
            rest = info.remaining();
            lastIsValue = false;
            for (SnippetEvent e : shell.eval(src)) {
                if (e.causeSnippet() != null) continue;  // an update of a dependent snippet
                if (e.exception() != null) {
                    Throwable t = e.exception();
                    String name = t instanceof EvalException ? ((EvalException) t).getExceptionClassName()
                            : t.getClass().getName();
                    StringWriter sw = new StringWriter();
                    t.printStackTrace(new PrintWriter(sw));
                    System.out.flush();
                    error(name, String.valueOf(t.getMessage()), sw.toString());
                    return;
                }
                if (e.status() == Snippet.Status.REJECTED) {
                    StringBuilder msg = new StringBuilder();
                    shell.diagnostics(e.snippet()).forEach(d -> msg.append(d.getMessage(Locale.ROOT)).append('\n'));
                    error("CompilationException", msg.toString().strip(), src.strip() + "\n" + msg);
                    return;
                }
                Snippet s = e.snippet();
                if (e.status() == Snippet.Status.RECOVERABLE_NOT_DEFINED
                        || e.status() == Snippet.Status.RECOVERABLE_DEFINED) {
                    // jshell keeps a declaration that names what does not exist yet; a kernel says so
                    List<String> missing = s instanceof DeclarationSnippet
                            ? shell.unresolvedDependencies((DeclarationSnippet) s).toList() : List.of();
                    String msg = "cannot find symbol: " + String.join(", ", missing);
                    error("CompilationException", msg, src.strip() + "\n" + msg);
                    return;
                }
                boolean isValue = s.kind() == Snippet.Kind.EXPRESSION
                        || (s.kind() == Snippet.Kind.VAR && s.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND);
                if (isValue && e.value() != null) {
                    String type = s instanceof VarSnippet ? ((VarSnippet) s).typeName()
                            : ((ExpressionSnippet) s).typeName();
                    lastValue = "String".equals(type) || "java.lang.String".equals(type) ? unquote(e.value()) : e.value();
                    lastIsValue = !"void".equals(type);
                }
            }
        }
        System.out.flush();
        System.err.flush();
        if (lastIsValue && lastValue != null) {
            frame("{\"line\":true}", "{\"type\":\"result\",\"text\":" + json(lastValue) + ",\"extra\":{},\"is_main_result\":true}");
        }
    }

    public static void main(String[] args) throws Exception {
        ctrlOut = new FileOutputStream(fd(3));
        BufferedReader ctrlIn = new BufferedReader(new InputStreamReader(new FileInputStream(fd(3)), StandardCharsets.US_ASCII));
        System.setIn(new ByteArrayInputStream(new byte[0]));
        System.setOut(new PrintStream(new LineStream("stdout"), true, StandardCharsets.UTF_8));
        System.setErr(new PrintStream(new LineStream("stderr"), true, StandardCharsets.UTF_8));
        System.getenv().forEach((k, v) -> { if (System.getProperty(k) == null) System.setProperty(k, v); });
        JShell shell = JShell.builder().executionEngine("local").out(System.out).err(System.err).build();
        shell.eval("int __agentcell_warm = 1;");  // the compiler's first use is slow: paid while starting
        final JShell theShell = shell;
        try {
            sun.misc.Signal.handle(new sun.misc.Signal("INT"), sig -> theShell.stop());
        } catch (Throwable ignored) {
            // no signal handling: the agent kills the kernel after its grace period
        }
        frame("{\"warm\":true}", "");
        String line;
        Base64.Decoder dec = Base64.getDecoder();
        while ((line = ctrlIn.readLine()) != null) {
            String[] parts = line.split(" ");
            if (parts.length >= 1 && parts[0].equals("E")) {
                pairs(parts, 1).forEach(System::setProperty);
                frame("{\"done\":true}", "");
                continue;
            }
            if (parts.length < 2 || !parts[0].equals("R")) continue;
            String code = new String(dec.decode(parts[1]), StandardCharsets.UTF_8);
            Map<String, String> extra = pairs(parts, 2);
            Map<String, String> saved = new HashMap<>();
            extra.forEach((k, v) -> saved.put(k, System.getProperty(k)));
            extra.forEach(System::setProperty);
            frame("{\"line\":true,\"hold\":true}", "{\"type\":\"number_of_executions\",\"execution_count\":" + (runs++) + "}");
            try {
                run(shell, code);
            } catch (Throwable t) {
                error(t.getClass().getName(), String.valueOf(t.getMessage()), t.toString());
            } finally {
                saved.forEach((k, v) -> { if (v == null) System.clearProperty(k); else System.setProperty(k, v); });
                System.out.flush();
                System.err.flush();
                frame("{\"done\":true}", "");
            }
        }
    }
}
