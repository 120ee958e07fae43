# SPDX-License-Identifier: Apache-2.0
"""The compliance checks. Each names the spec sections it enforces (W = docs/spec/wire.md,
C = docs/spec/congestion.md, L = docs/spec/link.md) in its name, its docstring and every failure
message. A check talks to the IUT only through the wire (tester.Port) and plain verbs (the agent);
checks marked "counters" also read the IUT's counters and skip that part without them."""
import random
import socket
import time

import mrwire as w
from tester import Direction, Fail, Skip, pattern

CHECKS = []

WC_SUCCESS, WC_RETRY_EXC_ERR = 0, 12
RTO_MIN_S = 200e-6          # W§7 defaults: rto_min 200 µs
RTO_MAX_S = 0.1             # rto_max 100 ms


def check(name, sections, counters=False):
    def deco(fn):
        fn.check_name, fn.sections, fn.counters = name, sections, counters
        CHECKS.append(fn)
        return fn
    return deco


def expect(cond, msg, sections):
    if not cond:
        raise Fail(f"{msg} ({sections})")


class Ctx:
    """What a check works with: the port, the agent, counters, fresh tester addresses."""

    def __init__(self, port, agent, counters, ip_pool, rx_capacity, notes, rto_initial=1e-3,
                 kernel_udp=False):
        self.port, self.agent, self.counters = port, agent, counters
        self.rto_initial, self.kernel_udp = rto_initial, kernel_udp
        self.ip_pool, self.rx_capacity, self.notes = ip_pool, rx_capacity, notes
        self.stream = random.randrange(0x10000, 0x20000)

    def note(self, text):
        self.notes.append(text)

    def new_ip(self):
        if not self.ip_pool:
            raise Skip("out of tester addresses")
        ip = self.ip_pool.pop(0)
        self.port.add_ip(ip)
        return ip

    def qp(self, ip, **attrs):
        """An RC QP of the IUT connected to a new stream of the tester at ip."""
        self.stream += 1
        r = self.agent("qp", ip=ip, qpn=self.stream, **attrs)
        return r["qp"], r["qpn"], self.stream

    def mr(self, size, fill=0):
        return self.agent("mr", size=size, fill=fill)

    def mem(self, mr, offset, n):
        return bytes.fromhex(self.agent("read", mr=mr["mr"], offset=offset, len=n)["hex"])

    def wcs(self, n, timeout):
        """Polls the IUT's CQ for n completions while the tester keeps answering the wire."""
        out, end = [], time.monotonic() + timeout
        while len(out) < n and time.monotonic() < end:
            out += self.agent("poll", max=n - len(out), wait_ms=10)["wcs"]
        return out

    def quiet(self, d, mark, seconds):
        """ACKs of direction d since mark, after seconds of listening."""
        self.port.pump(seconds)
        return d.acks(mark)

    def wait_ack(self, d, mark, path, pred, timeout=2.0):
        """The first ACK of d on path since mark that satisfies pred, or None."""
        found = []

        def done():
            for f in d.acks(mark, path):
                if pred(f.mrh):
                    found.append(f)
                    return True
            return False
        self.port.pump(timeout, until=done)
        return found[0] if found else None

    def counter_deltas(self, before, until, timeout=3.0, exact=True):
        """The counters' movement since before (a dict of differences), once until(movement) holds
        or timeout seconds have passed. An engine publishes its counters periodically (ours:
        every 100 ms) and a loaded host can delay that, so a fixed wait would read too early.
        With exact, one more publication is awaited after the goal is reached, so that a count
        beyond it is seen too."""
        def delta():
            after = self.counters.read()
            return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
        end = time.monotonic() + timeout
        while True:
            self.port.pump(0.05)
            moved = delta()
            if until(moved):
                if not exact:
                    return moved
                self.port.pump(0.25)
                return delta()
            if time.monotonic() > end:
                return moved

    @staticmethod
    def drops(delta):
        """The drop counters that moved, for a failure's message."""
        return {k: v for k, v in sorted(delta.items()) if v and k.startswith(("drop", "rx_drop"))}


def write_pkt(d, path, qpn, stream, msn, mr, at, data, seq=None, part=None, **kw):
    """A WRITE (W§2.2) of data to byte `at` of region mr: the whole message, or with
    part=(offset, total_length) one packet of a message of total_length bytes based there."""
    offset, total = part or (0, len(data))
    m = d.header(path, seq, opcode=w.WRITE, dst_stream=qpn, src_stream=stream, msn=msn,
                 offset=offset, total_length=total, remote_addr=mr["addr"] + at, rkey=mr["rkey"],
                 payload=data)
    m.__dict__.update(kw)
    return m


def send_pkt(d, path, qpn, stream, msn, rsn, data, seq=None, **kw):
    m = d.header(path, seq, opcode=w.SEND, dst_stream=qpn, src_stream=stream, msn=msn, rsn=rsn,
                 offset=0, total_length=len(data), payload=data)
    m.__dict__.update(kw)
    return m


def open_direction(ctx, d, qpn, stream, mr, offset, seed):
    """Sends d's first packet (a WRITE of 32 bytes at offset) and waits for its ACK: the
    direction then exists at the IUT (W§3.2: its first valid packet creates it)."""
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 0, mr, offset, pattern(32, seed)))
    expect(ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 1) is not None,
           "the direction's first valid packet got no ACK", "W§3.2 W§5.2")


def describe(acks):
    return "; ".join(repr(f.mrh) for f in acks[-4:]) or "none"


# --- (a) gap on a path -> SACK ---------------------------------------------------------------

@check("sack_shows_exactly_the_received_sequences", "W§5.1 W§5.2 W§2.3 W§3.3")
def sack_gap(ctx):
    """A WRITE of 6 packets on path 1 of a 4-path direction with sequences 2 and 4 held back:
    every ACK names only what arrived (W§2.3), one ACK per path that received, only on those
    paths (W§5.2), from the packet's UDP source port (W§3.3), echoing the newest timestamp
    (W§5.2); the last one has cum_seq 2 and SACK exactly {3, 5}. Then 2 and 4 arrive: cum_seq 6,
    empty SACK, and the IUT's memory holds the message byte for byte."""
    s = "W§5.1 W§5.2 W§2.3"
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0xa5)
    _, qpn, stream = ctx.qp(ip)
    d = Direction(ctx.port, ip, 4)
    data = pattern(6 * 64, 1)
    pkts = {}

    def send(k):   # stamped as it leaves: the newest packet has the newest timestamp
        pkts[k] = d.send(write_pkt(d, 1, qpn, stream, 0, mr, 0, data[64 * k:64 * k + 64],
                                   seq=k, part=(64 * k, len(data))))
    mark = len(ctx.port.log)
    for k in (0, 1, 3, 5):
        send(k)
    last = ctx.wait_ack(d, mark, 1, lambda a: a.cum_seq == 2 and a.sacked() == [3, 5])
    acks = ctx.quiet(d, mark, 0.2)
    expect(last is not None, f"no ACK with cum_seq 2 and SACK {{3, 5}}; got {describe(acks)}", s)
    received = {0, 1, 3, 5}
    for f in acks:
        a = f.mrh
        expect(a.path_id == 1, f"ACK on path {a.path_id}, which received nothing", "W§5.2")
        named = set(range(a.cum_seq)) | set(a.sacked())
        expect(named <= received, f"ACK names sequences never sent: {sorted(named - received)} "
               f"in {a!r}", "W§2.3")
        expect(f.sport == d.sport[1], f"ACK from UDP port {f.sport}, not the path's {d.sport[1]}",
               "W§3.3")
    expect(len(acks) <= 4, f"{len(acks)} ACKs for 4 packets on one path", "W§5.2")
    expect(acks[-1].mrh.cum_seq == 2 and acks[-1].mrh.sacked() == [3, 5],
           f"last ACK {acks[-1].mrh!r}: want cum_seq 2, SACK {{3, 5}}", s)
    expect(acks[-1].mrh.echo_timestamp == pkts[5].timestamp,
           f"echo_timestamp {acks[-1].mrh.echo_timestamp}: the newest packet's is "
           f"{pkts[5].timestamp}", "W§5.2")
    got = ctx.mem(mr, 0, len(data))
    for k in range(6):
        want = data[64 * k:64 * k + 64] if k in received else b"\xa5" * 64
        expect(got[64 * k:64 * k + 64] == want, f"bytes of sequence {k} wrong in the IUT's memory",
               "W§5.1")
    mark = len(ctx.port.log)
    send(2)
    send(4)
    last = ctx.wait_ack(d, mark, 1, lambda a: a.cum_seq == 6)
    expect(last is not None, f"no ACK with cum_seq 6 after the gaps filled: {describe(d.acks(mark))}", s)
    expect(last.mrh.sack == 0, f"SACK not empty at cum_seq 6: {last.mrh!r}", s)
    expect(last.mrh.echo_timestamp == pkts[4].timestamp,
           f"echo_timestamp {last.mrh.echo_timestamp}: the newest packet's is "
           f"{pkts[4].timestamp}", "W§5.2")
    expect(ctx.mem(mr, 0, len(data)) == data, "IUT memory differs from the WRITE", "W§4.1")


# --- (b) rate hint in every ACK --------------------------------------------------------------

@check("rate_hint_in_every_ack", "C§3.2 C§3.3 W§2.3")
def rate_hint(ctx):
    """Two senders (two tester addresses) stream WRITEs at once. Every ACK the IUT sends them
    carries a rate_hint: with the IUT's receive capacity C known and non-zero, 0 < hint <=
    0.95 C (C§3.2: shares add up to C' = 95 % of C; admission gives a first ACK a share); with
    C = 0, 0 (none, W§2.3). Every ACK of the checks run before is at most C' too. The latest
    shares of the two senders add up to at most C'."""
    s = "C§3.2 C§3.3 W§2.3"
    if ctx.rx_capacity is None:
        raise Skip("the IUT's receive capacity is not given (--rx-capacity)")
    cap = ctx.rx_capacity
    senders = []
    for seed in (1, 2):
        ip = ctx.new_ip()
        mr = ctx.mr(1 << 16)
        _, qpn, stream = ctx.qp(ip)
        senders.append((Direction(ctx.port, ip, 4), mr, qpn, stream))
    mark = len(ctx.port.log)
    payload = pattern(1024, 7)
    end = time.monotonic() + 0.5
    msn = 0
    # The senders' packets alternate one by one: the IUT closes a division with a data packet
    # once hint_interval (20 us) has passed, and counts a sender active for 3 divisions (C§3.1).
    # Four packets of one sender in a row would make a slow IUT (a sanitized build) close 4
    # divisions with the other sender idle, and give the one it hears all of C'.
    while time.monotonic() < end:
        for p in range(4):
            for d, mr, qpn, stream in senders:
                d.send(write_pkt(d, p, qpn, stream, msn, mr, 0, payload))
        msn += 1
        ctx.port.pump(0.002)
    ctx.port.pump(0.2)
    latest = []
    for d, *_ in senders:
        acks = d.acks(mark)
        expect(acks, f"no ACK to sender {d.src_ip}", "W§5.2")
        latest.append(acks[-1].mrh.rate_hint)
        ctx.note(f"{d.src_ip}: {len(acks)} ACKs, lowest hints "
                 f"{sorted({f.mrh.rate_hint for f in acks})[:4]}, last {[f.mrh.rate_hint for f in acks[-4:]]}")
    # Every ACK of the run: at most C' (C§3.3), 0 without a capacity (W§2.3). Those answering
    # this check's data also carry a share (> 0): the senders are active, or admitted at once
    # (C§3.2); an ACK to a sender idle for 3 intervals (a probe's, a late resend's) may say 0.
    everything = [f for f in ctx.port.log if f.mrh.opcode == w.ACK]
    ours = {id(f) for d, *_ in senders for f in d.acks(mark)}
    for f in everything:
        h = f.mrh.rate_hint
        if cap:
            low = 0 if id(f) in ours else -1
            expect(low < h <= cap * 0.95 + 1,
                   f"rate_hint {h} Mbit/s outside ({max(low, 0)}, 0.95 x {cap}] in {f.mrh!r}", s)
        else:
            expect(h == 0, f"rate_hint {h} from an IUT without a receive capacity", "W§2.3")
    if cap:
        # Each division's shares add up to C' exactly; the two latest ACKs may come from two
        # divisions (every hint_interval), so 2 % of slack.
        expect(sum(latest) <= cap * 0.95 * 1.02,
               f"the two senders' shares {latest} add up to more than 0.95 x {cap}", "C§3.2")
    ctx.note(f"{len(everything)} ACKs checked, capacity {cap} Mbit/s, latest shares {latest}")


# --- (c) NAK codes ---------------------------------------------------------------------------

def nak_case(ctx, d, qpn, stream, mr, seq, m, syndrome, label):
    mark = len(ctx.port.log)
    d.send(m)
    f = ctx.wait_ack(d, mark, 0, lambda a: any(n[0] == seq for n in a.naks), timeout=2.0)
    expect(f is not None, f"{label}: no NAK record for sequence {seq}; ACKs: {describe(d.acks(mark))}",
           "W§5.3 W§2.4")
    n = next(n for n in f.mrh.naks if n[0] == seq)
    expect(n[3] == syndrome, f"{label}: syndrome {n[3]} ({w.SYN_NAMES.get(n[3], '?')}), want "
           f"{syndrome} ({w.SYN_NAMES[syndrome]})", "W§2.4 W§5.3")
    expect(n[1] == stream and n[2] == m.msn, f"{label}: NAK names stream {n[1]:#x} msn {n[2]}, "
           f"want {stream:#x} msn {m.msn}", "W§2.4")
    return f


@check("nak_codes_rkey_bounds_rnr", "W§5.3 W§2.4 C§6")
def naks(ctx):
    """A WRITE with a bad rkey gets NAK syndrome 2 and an out-of-bounds WRITE syndrome 3, each
    marked received (cum_seq passes it) and repeated in every ACK of the path until the ack
    floor passes it (W§5.3); neither touches memory. A SEND to a QP with no receive posted gets
    RNR (syndrome 1) with rnr_timer 0x80 | the QP's min_rnr_timer (W§2.4), not marked received,
    in one ACK only (C§6); once a receive is posted the same packet is delivered."""
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0x11)
    d = Direction(ctx.port, ip, 1)
    data = pattern(64, 3)
    # Bad rkey.
    _, qpn, stream = ctx.qp(ip)
    m = write_pkt(d, 0, qpn, stream, 0, mr, 0, data, rkey=mr["rkey"] ^ 0x00777700)
    f = nak_case(ctx, d, qpn, stream, mr, 0, m, w.SYN_ACCESS, "bad rkey")
    expect(f.mrh.cum_seq == 1, f"bad rkey: rejected sequence not marked received: {f.mrh!r}", "W§5.3")
    # The record rides every ACK of the path until the ack floor passes it.
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 1, mr, 0, data, rkey=mr["rkey"] ^ 0x00777700))
    f2 = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 2)
    expect(f2 is not None and any(n[0] == 0 for n in f2.mrh.naks),
           f"the NAK of sequence 0 is missing from the next ACK of the path: {describe(d.acks(mark))}",
           "W§5.3")
    mark = len(ctx.port.log)
    _, qpn2, stream2 = ctx.qp(ip)
    d.send(write_pkt(d, 0, qpn2, stream2, 0, mr, 128, data, ack_floor=2))
    f3 = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 3)
    expect(f3 is not None, f"no ACK for the packet after the rejections: {describe(d.acks(mark))}",
           "W§5.2")
    expect(not any(n[0] in (0, 1) for n in f3.mrh.naks),
           f"NAK records kept after the ack floor passed them: {f3.mrh!r}", "W§5.3")
    expect(ctx.mem(mr, 0, 64) == b"\x11" * 64, "a WRITE refused for its rkey changed memory", "W§5.3")
    expect(ctx.mem(mr, 128, 64) == data, "the valid WRITE after the rejections did not land", "W§5.1")
    # Out of bounds: a valid rkey, the last 32 bytes inside the region, 32 beyond.
    _, qpn, stream = ctx.qp(ip)
    m = write_pkt(d, 0, qpn, stream, 0, mr, 4096 - 32, data)
    f = nak_case(ctx, d, qpn, stream, mr, 3, m, w.SYN_BOUNDS, "out-of-bounds WRITE")
    expect(f.mrh.cum_seq == 4, f"out-of-bounds: rejected sequence not marked received: {f.mrh!r}",
           "W§5.3")
    expect(ctx.mem(mr, 4096 - 32, 32) == b"\x11" * 32, "an out-of-bounds WRITE changed memory",
           "W§5.3")
    # RNR: a SEND to a QP with no receive posted.
    qp, qpn, stream = ctx.qp(ip, min_rnr_timer=14)
    msg = pattern(100, 4)
    m = send_pkt(d, 0, qpn, stream, 0, 0, msg)
    f = nak_case(ctx, d, qpn, stream, mr, 4, m, w.SYN_RNR, "SEND without a receive")
    n = next(n for n in f.mrh.naks if n[0] == 4)
    expect(n[4] == 0x80 | 14, f"RNR rnr_timer {n[4]:#x}, want 0x8e (0x80 | min_rnr_timer 14)", "W§2.4")
    expect(f.mrh.cum_seq == 4, f"an RNR-refused sequence was marked received: {f.mrh!r}", "W§5.3")
    mark = len(ctx.port.log)
    _, qpn3, stream3 = ctx.qp(ip)
    d.send(write_pkt(d, 0, qpn3, stream3, 0, mr, 256, data, ack_floor=4))
    f = ctx.wait_ack(d, mark, 0, lambda a: 5 in a.sacked())
    expect(f is not None, f"no ACK for the packet after the RNR: {describe(d.acks(mark))}", "W§5.2")
    expect(not any(n[3] == w.SYN_RNR for n in f.mrh.naks),
           f"the RNR record was sent in more than one ACK: {f.mrh!r}", "C§6 W§5.3")
    ctx.agent("post_recv", qp=qp, mr=mr["mr"], offset=1024, len=256, wr_id=77)
    mark = len(ctx.port.log)
    d.send(m)   # the same packet again: the retry after the back-off
    f = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 6)
    expect(f is not None, f"the SEND retried after a receive was posted was not accepted: "
           f"{describe(d.acks(mark))}", "C§6")
    wcs = ctx.wcs(1, 2.0)
    expect(len(wcs) == 1 and wcs[0]["wr_id"] == 77 and wcs[0]["status"] == WC_SUCCESS and
           wcs[0]["len"] == 100, f"receive completion {wcs}: want wr_id 77, success, 100 bytes", "C§6")
    expect(ctx.mem(mr, 1024, 100) == msg, "the SEND's bytes differ in the receive buffer", "W§5.1")


# --- (d) malformed packets -------------------------------------------------------------------

def malformed_cases(d, qpn, stream, mr, seq, data):
    """The variants: (label, the counters any of which must count it (None: not countable
    here), the spec sections, the send_udp arguments that make the frame)."""
    def base(**kw):
        m = write_pkt(d, 0, qpn, stream, 5, mr, 0, data, seq=seq)
        m.__dict__.update(kw)
        return m

    def enc(m):
        return {"payload": m.encode()}
    good = base()
    ack = w.Mrh(opcode=w.ACK, conn_id=d.conn_id ^ 0x13572468, token=d.token, path_id=0,
                path_count=1, cum_seq=0)
    cases = [
        ("version 2", {"drop_version"}, "W§2.1", enc(base(version=2))),
        ("version 0", {"drop_version"}, "W§2.1", enc(base(version=0))),
        ("opcode 0", {"drop_malformed"}, "W§2.1", enc(base(opcode=0))),
        ("opcode 10", {"drop_malformed"}, "W§2.1", enc(base(opcode=10))),
        ("opcode 15", {"drop_malformed"}, "W§2.1", enc(base(opcode=15))),
        ("opcode 18", {"drop_malformed"}, "W§2.1", enc(base(opcode=18))),
        ("opcode 255", {"drop_malformed"}, "W§2.1", enc(base(opcode=255))),
        ("token wrong", {"drop_token"}, "W§2.1 W§3.2", enc(base(token=d.token ^ 1))),
        ("conn_id 0", {"drop_malformed"}, "W§2.1", enc(base(conn_id=0))),
        ("path_id = path_count", {"drop_malformed"}, "W§2.1", enc(base(path_id=d.path_count))),
        ("path_count 0", {"drop_malformed"}, "W§2.1", enc(base(path_count=0))),
        ("path_count 257", {"drop_malformed"}, "W§2.1", enc(base(path_count=257))),
        ("ack_floor above path_seq", {"drop_malformed"}, "W§2.1", enc(base(ack_floor=seq + 1))),
        ("failover copy of a path >= path_count", {"drop_malformed"}, "W§2.1",
         enc(base(flags=w.F_FAILOVER | d.path_count))),
        ("XRC flag on READ_RESP", {"drop_malformed"}, "W§2.1",
         enc(base(opcode=w.READ_RESP, flags=w.F_XRC))),
        ("rsn on a WRITE", {"drop_malformed"}, "W§2.2", enc(base(rsn=3))),
        ("payload_len + 1", {"drop_malformed"}, "W§2.2", enc(base(payload_len=len(data) + 1))),
        ("payload_len - 1", {"drop_malformed"}, "W§2.2", enc(base(payload_len=len(data) - 1))),
        ("offset + payload > total_length", {"drop_malformed"}, "W§2.2",
         enc(base(offset=8, total_length=len(data)))),
        ("remote_addr + total_length wraps", {"drop_malformed"}, "W§2.2",
         enc(base(remote_addr=2**64 - 16))),
        ("READ_REQ with payload_len", {"drop_malformed"}, "W§2.2",
         enc(base(opcode=w.READ_REQ, payload=b"", payload_len=4))),
        ("atomic of 8 bytes", {"drop_malformed"}, "W§2.2",
         enc(base(opcode=w.CMP_SWP, payload=data[:8], total_length=8))),
        ("ATOMIC_WRITE of 16 bytes", {"drop_malformed"}, "W§2.2",
         enc(base(opcode=w.ATOMIC_WRITE, payload=data[:16], total_length=16))),
        ("truncated data header", {"drop_malformed"}, "W§2.2", {"payload": good.encode()[:60]}),
        ("truncated base header", {"drop_malformed"}, "W§2.1", {"payload": good.encode()[:20]}),
        ("ACK for an unknown direction", {"drop_unknown_conn"}, "W§3.2", enc(ack)),
        ("ACK with nak_count 17", {"drop_malformed", "drop_unknown_conn"}, "W§2.3",
         {"payload": w.Mrh(**{**ack.__dict__, "nak_count": 17}).encode() + b"\0" * 16 * 17}),
        ("ACK NAK syndrome 6", {"drop_malformed", "drop_unknown_conn"}, "W§2.4",
         enc(w.Mrh(**{**ack.__dict__, "naks": [(0, stream, 0, 6, 0, 0)]}))),
        ("ACK one byte long", {"drop_malformed", "drop_unknown_conn"}, "W§2.3",
         {"payload": ack.encode() + b"\0"}),
        ("PROBE of 36 bytes", {"drop_malformed"}, "W§2.5",
         {"payload": d.header(0, seq, opcode=w.PROBE).encode() + b"\0" * 4}),
        ("PROBE for an unknown direction", {"drop_unknown_conn"}, "W§2.5",
         enc(w.Mrh(**{**d.header(0, seq, opcode=w.PROBE).__dict__, "conn_id": d.conn_id ^ 0x2468}))),
        ("IPv4 header checksum wrong", {"rx_drop_malformed", "drop_malformed"}, "W§1",
         {**enc(good), "bad_ip_csum": True}),
        # Not counted through an af_packet port: DPDK's af_packet PMD joins a fanout with
        # PACKET_FANOUT_FLAG_DEFRAG, so the kernel holds a lone fragment for reassembly and the
        # IUT never sees it. Dropped and unanswered is what can be checked.
        ("IPv4 fragment (MF)", None, "W§1", {**enc(good), "frag": 0x2000}),
        ("IPv4 total length beyond the frame", {"rx_drop_malformed", "drop_malformed"}, "W§1",
         {**enc(good), "ip_total": 20 + 8 + len(good.encode()) + 40}),
        ("UDP length beyond the IP payload", {"rx_drop_malformed", "drop_malformed"}, "W§1",
         {**enc(good), "udp_len": 8 + len(good.encode()) + 4}),
        ("UDP length below 8", {"rx_drop_malformed", "drop_malformed"}, "W§1",
         {**enc(good), "udp_len": 6}),
        ("UDP checksum wrong", {"rx_drop_malformed", "drop_malformed"}, "W§1",
         {**enc(good), "udp_csum": 0x1234}),
        ("IPv4 version 6", {"rx_drop_malformed", "drop_malformed", "rx_drop_not_ours"}, "W§1",
         {**enc(good), "version_ihl": 0x65}),
    ]
    return good, cases


@check("malformed_fields_dropped_and_counted", "W§1 W§2 W§3.2", counters=True)
def malformed(ctx):
    """Each malformed field of W§1/W§2 (and a wrong token, an ACK or PROBE of an unknown
    direction, W§3.2, W§2.5) in a packet otherwise valid: dropped, no ACK, memory untouched,
    and (with counters) counted under the counter the spec names (IPv4/UDP faults not, where
    the IUT receives through the host's UDP sockets: the kernel drops those); afterwards the
    same sequence is still free and the valid packet lands (nothing of the bad ones was marked
    received)."""
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0x22)
    _, qpn, stream = ctx.qp(ip)
    d = Direction(ctx.port, ip, 2)
    open_direction(ctx, d, qpn, stream, mr, 512, 5)   # so that a wrong token is one
    data = pattern(64, 6)
    good, cases = malformed_cases(d, qpn, stream, mr, 1, data)
    have_counters = ctx.counters.available()
    failures = []
    by_counter = {}
    for label, names, sections, frame in cases:
        if ctx.kernel_udp and sections == "W§1":
            names = None   # the host's IP/UDP stack drops these before the IUT sees them
        before = ctx.counters.read() if have_counters and names else None
        mark = len(ctx.port.log)
        payload = frame.pop("payload")
        ctx.port.send_udp(ip, d.sport[0], payload, **frame)
        counted, delta = set(), {}
        if before is None:
            ctx.port.pump(0.05)
        else:
            delta = ctx.counter_deltas(before, lambda m: any(m.get(n, 0) > 0 for n in names),
                                       timeout=1.0, exact=False)
            counted = {n for n in names if delta.get(n, 0) > 0}
        replies = ctx.port.frames_since(mark, lambda f: f.dst_ip == ip)
        if replies:
            failures.append(f"{label}: answered with {replies[0].mrh!r} ({sections})")
        for n in counted:
            by_counter.setdefault(n, []).append(label)
        if before is not None and not counted:
            failures.append(f"{label}: not counted under {'/'.join(sorted(names))} "
                            f"(drop counters moved: {ctx.drops(delta) or 'none'}) ({sections})")
    expect(ctx.mem(mr, 0, 64) == b"\x22" * 64, "a malformed WRITE changed the IUT's memory", "W§2")
    mark = len(ctx.port.log)
    d.send(good)
    f = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 2)
    if f is None:
        failures.append(f"the valid packet at the sequence the malformed ones used got no "
                        f"ACK with cum_seq 2: {describe(d.acks(mark))} (W§2: a drop marks nothing)")
    elif ctx.mem(mr, 0, 64) != data:
        failures.append("the valid WRITE after the malformed ones did not land (W§5.1)")
    ctx.note(f"{len(cases)} malformed variants" + ("" if have_counters else ", counters not read"))
    for n, labels in sorted(by_counter.items()):
        ctx.note(f"{n}: {len(labels)}" + (f" ({', '.join(labels)})" if len(labels) < 10 else ""))
    if failures:
        raise Fail("; ".join(failures))


# --- (e) duplicates --------------------------------------------------------------------------

@check("duplicates_acked_not_applied_twice", "W§5.1 W§5.2 C§4.3")
def duplicates(ctx):
    """A SEND received twice on its path is re-ACKed and delivered once (one completion; the
    second receive stays posted). A WRITE received twice is not applied again (memory the IUT
    changed locally in between keeps its value). A failover copy (W§2.1 flag, orig_seq) of a
    SEND whose original arrived is ACKed on its own path and not delivered (C§4.3)."""
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0x33)
    d = Direction(ctx.port, ip, 2)
    qp, qpn, stream = ctx.qp(ip)
    for i in range(3):
        ctx.agent("post_recv", qp=qp, mr=mr["mr"], offset=1024 * (i + 1), len=512, wr_id=100 + i)
    msg = pattern(200, 8)
    m = send_pkt(d, 0, qpn, stream, 0, 0, msg)
    mark = len(ctx.port.log)
    d.send(m)
    expect(ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 1) is not None,
           f"the SEND got no ACK: {describe(d.acks(mark))}", "W§5.2")
    wcs = ctx.wcs(1, 2.0)
    mark = len(ctx.port.log)
    d.send(m)
    f = ctx.wait_ack(d, mark, 0, lambda a: True)
    expect(f is not None, "a duplicate was not re-ACKed", "W§5.1")
    expect(f.mrh.cum_seq == 1, f"the re-ACK of a duplicate moved cum_seq: {f.mrh!r}", "W§5.1")
    # A failover copy on path 1 naming the original (path 0, sequence 0): already delivered.
    mark = len(ctx.port.log)
    d.send(send_pkt(d, 1, qpn, stream, 0, 0, msg, flags=w.F_FAILOVER | 0, orig_seq=0))
    f = ctx.wait_ack(d, mark, 1, lambda a: a.cum_seq == 1)
    expect(f is not None, f"a failover copy of a delivered packet was not ACKed on its path: "
           f"{describe(d.acks(mark))}", "C§4.3")
    wcs += ctx.wcs(2, 0.5)
    expect(len(wcs) == 1 and wcs[0]["wr_id"] == 100 and wcs[0]["len"] == 200,
           f"a SEND seen three times (original, duplicate, failover copy) completed {len(wcs)} "
           f"receives: {wcs}", "W§5.1 C§4.3")
    expect(ctx.mem(mr, 1024, 200) == msg, "the SEND's bytes differ in the receive buffer", "W§5.1")
    expect(ctx.mem(mr, 2048, 200) == b"\x33" * 200, "the second receive buffer was written", "W§5.1")
    # A WRITE applied once: the IUT's application changes the bytes, the duplicate must not
    # write them back.
    _, qpn2, stream2 = ctx.qp(ip)
    data = pattern(128, 9)
    m = write_pkt(d, 0, qpn2, stream2, 0, mr, 0, data)
    mark = len(ctx.port.log)
    d.send(m)
    expect(ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 2) is not None,
           f"the WRITE got no ACK: {describe(d.acks(mark))}", "W§5.2")
    expect(ctx.mem(mr, 0, 128) == data, "the WRITE did not land", "W§5.1")
    ctx.agent("write", mr=mr["mr"], offset=0, hex=("ee" * 128))
    mark = len(ctx.port.log)
    d.send(m)
    expect(ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 2) is not None,
           "the duplicate WRITE was not re-ACKed", "W§5.1")
    expect(ctx.mem(mr, 0, 128) == b"\xee" * 128, "a duplicate WRITE was applied a second time",
           "W§5.1")


# --- (f) out-of-window -----------------------------------------------------------------------

@check("out_of_window_dropped", "W§5.1", counters=True)
def out_of_window(ctx):
    """With cum_seq 0 the window is 1..256: sequence 257 is dropped (no ACK, memory untouched,
    counted as out of window); sequence 256, the window's last, is taken and SACKed (bit 255);
    sequence 0 then moves cum_seq to 1 and keeps 256 in the SACK (bit 254)."""
    s = "W§5.1"
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0x44)
    _, qpn, stream = ctx.qp(ip)
    d = Direction(ctx.port, ip, 1)
    a, b, c = pattern(64, 10), pattern(64, 11), pattern(64, 12)
    before = ctx.counters.read() if ctx.counters.available() else None
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 0, mr, 0, a, seq=257))
    acks = ctx.quiet(d, mark, 0.3)
    expect(not acks, f"a packet 257 ahead of cum_seq 0 was ACKed: {describe(acks)}", s)
    expect(ctx.mem(mr, 0, 64) == b"\x44" * 64, "a packet out of the window was applied", s)
    if before is not None:
        delta = ctx.counter_deltas(before, lambda m: m.get("drop_out_of_window", 0) >= 1)
        expect(delta.get("drop_out_of_window", 0) == 1,
               f"drop_out_of_window moved by {delta.get('drop_out_of_window', 0)}, not 1 "
               f"(drop counters moved: {ctx.drops(delta) or 'none'})", s)
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 1, mr, 128, b, seq=256))
    f = ctx.wait_ack(d, mark, 0, lambda a: True)
    expect(f is not None, "the window's last sequence (cum_seq + 256) was not taken", s)
    expect(f.mrh.cum_seq == 0 and f.mrh.sacked() == [256],
           f"ACK {f.mrh!r}: want cum_seq 0, SACK {{256}} (bit 255)", s + " W§2.3")
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 2, mr, 256, c, seq=0))
    f = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 1)
    expect(f is not None and f.mrh.sacked() == [256],
           f"after sequence 0: {describe(d.acks(mark))}; want cum_seq 1, SACK {{256}}", s)
    expect(ctx.mem(mr, 128, 64) == b and ctx.mem(mr, 256, 64) == c,
           "the in-window WRITEs did not land", s)


# --- ECN echo, probes, the ack floor ----------------------------------------------------------

@check("ce_marks_echoed_per_path", "W§5.2 W§2.3 W§1 C§1")
def ce_echo(ctx):
    """Data packets the fabric marked CE (IPv4 ECN 3) are echoed: the ACKs of the path carry
    ecn_ce_count, the marks since the previous ACK (W§2.3, W§5.2), so over the ACKs of a burst
    they add up to the marked packets, and an ACK after an unmarked packet carries 0. Another
    path's ACK carries none of them."""
    s = "W§5.2 W§2.3"
    ip = ctx.new_ip()
    mr = ctx.mr(4096)
    _, qpn, stream = ctx.qp(ip)
    d = Direction(ctx.port, ip, 2)
    mark = len(ctx.port.log)
    marks = [True, False, True, True, False]
    for k, ce in enumerate(marks):
        d.send(write_pkt(d, 0, qpn, stream, k, mr, 64 * k, pattern(64, 20 + k)), tos=3 if ce else 2)
    d.send(write_pkt(d, 1, qpn, stream, len(marks), mr, 1024, pattern(64, 30)))
    ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == len(marks))
    ctx.wait_ack(d, mark, 1, lambda a: a.cum_seq == 1)
    acks = ctx.quiet(d, mark, 0.1)
    echoed = sum(f.mrh.ecn_ce_count for f in acks if f.mrh.path_id == 0)
    other = sum(f.mrh.ecn_ce_count for f in acks if f.mrh.path_id == 1)
    expect(echoed == sum(marks), f"ACKs of path 0 echo {echoed} CE marks, {sum(marks)} were "
           f"marked ({describe(acks)})", s)
    expect(other == 0, f"path 1's ACK echoes {other} CE marks of path 0's packets", s)
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 9, mr, 2048, pattern(64, 31)))
    f = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == len(marks) + 1)
    expect(f is not None and f.mrh.ecn_ce_count == 0,
           f"the ACK of an unmarked packet after the marked ones: {describe(d.acks(mark))}", s)


@check("probe_answered_and_ack_floor_applied", "W§2.5 W§3.1 W§5.1 W§3.3")
def probe_and_floor(ctx):
    """A PROBE of a known direction, from a new UDP source port, with path_seq 5 and ack_floor
    5, is answered by an ACK on its path, from the probe's port (W§3.3), echoing its timestamp
    and acknowledging everything below the floor (W§2.5, W§3.1). A data packet whose ack_floor
    is its own sequence is taken, the floor applied first (W§5.1): cum_seq passes it."""
    s = "W§2.5 W§3.1"
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0x66)
    _, qpn, stream = ctx.qp(ip)
    d = Direction(ctx.port, ip, 1)
    open_direction(ctx, d, qpn, stream, mr, 0, 40)
    d.sport[0] = 49152 + (d.sport[0] + 7919 - 49152) % 16384     # the path's entropy re-picked
    probe = d.header(0, 5, opcode=w.PROBE, ack_floor=5)
    mark = len(ctx.port.log)
    d.send(probe)
    f = ctx.wait_ack(d, mark, 0, lambda a: True)
    expect(f is not None, "a PROBE of a known direction was not answered", "W§2.5")
    expect(f.mrh.echo_timestamp == probe.timestamp,
           f"the probe's ACK echoes {f.mrh.echo_timestamp}, not its timestamp {probe.timestamp}", s)
    expect(f.mrh.cum_seq == 5 and f.mrh.sack == 0,
           f"the probe's ACK {f.mrh!r}: its ack_floor 5 makes cum_seq 5", s)
    expect(f.sport == d.sport[0], f"the probe's ACK left from port {f.sport}, not the probe's "
           f"{d.sport[0]}", "W§3.3")
    data = pattern(64, 41)
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 1, mr, 128, data, seq=7, ack_floor=7))
    f = ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 8)
    expect(f is not None, f"data with ack_floor = its sequence 7: want cum_seq 8, got "
           f"{describe(d.acks(mark))}", "W§5.1 W§3.1")
    expect(ctx.mem(mr, 128, 64) == data, "the packet after the floor did not land", "W§5.1")


@check("ack_without_the_token_acknowledges_nothing", "W§3.2 W§2.1 W§6.2", counters=True)
def forged_ack(ctx):
    """While the IUT's WRITE waits for its ACK, an ACK of the right direction and sequences
    but a wrong token is dropped (counted drop_token): the WRITE does not complete and its
    packet is sent again; the genuine ACK then completes it (W§3.2: an ACK is accepted only with
    its direction's token)."""
    s = "W§3.2"
    ip = ctx.new_ip()
    rx = Receiver(ctx.port, ip)
    rx.silent_paths = set(range(256))
    try:
        before = ctx.counters.read() if ctx.counters.available() else None
        iut_write(ctx, ip, 512, 90, timeout=18)   # 1.07 s: the QP outlives the check
        ctx.port.pump(2.0, until=lambda: rx.arrivals)
        expect(rx.arrivals, "the IUT sent nothing", s)
        first = rx.arrivals[0][1].mrh
        expect(first.is_data(), f"the IUT's first packet is no data: {first!r}", s)
        forged = w.Mrh(opcode=w.ACK, conn_id=first.conn_id, token=first.token ^ 0x8000_0000_0000_0001,
                       path_id=first.path_id, path_count=first.path_count,
                       cum_seq=first.path_seq + 1, echo_timestamp=first.timestamp)
        n0 = len(rx.arrivals)
        ctx.port.send_mrh(ip, rx.arrivals[0][1].sport, forged)
        wcs = ctx.wcs(1, 0.05)
        expect(not wcs, f"a WRITE completed on an ACK with a wrong token: {wcs}", s)
        ctx.port.pump(2.0, until=lambda: len(rx.arrivals) > n0)
        expect(len(rx.arrivals) > n0, "the packet was not sent again after the forged ACK", s)
        if before is not None:
            delta = ctx.counter_deltas(before, lambda m: m.get("drop_token", 0) >= 1,
                                      exact=False)
            expect(delta.get("drop_token", 0) >= 1, f"drop_token moved by "
                   f"{delta.get('drop_token', 0)} for an ACK with a wrong token (drop counters "
                   f"moved: {ctx.drops(delta) or 'none'})", s)
        rx.silent_paths = set()
        for t, f, fate in rx.arrivals:
            if f.mrh.is_data():
                rx.ack(f.mrh.path_id, f.mrh.timestamp, f.sport)
        wcs = ctx.wcs(1, 3.0)
        expect(len(wcs) == 1 and wcs[0]["status"] == WC_SUCCESS,
               f"the genuine ACKs did not complete the WRITE: {wcs}", "W§6.2")
    finally:
        rx.close()


# --- the tester as receiver of the IUT's data --------------------------------------------------

class Receiver:
    """Receives the IUT's data sent to one tester address like a spec receiver (W§5), and
    ACKs each packet at once. drop(frame) -> True loses a packet (not recorded, no ACK);
    silent_paths get no ACK at all."""

    def __init__(self, port, ip, drop=None, refuse=None):
        self.port, self.ip = port, ip
        self.drop = drop or (lambda f: False)
        # refuse(frame) -> None or (syndrome, rnr_timer): the tester's NIC rejects the packet
        # (W§5.3): RNR leaves it unmarked with a record in one ACK; any other syndrome marks it
        # and its record rides every later ACK of the path.
        self.refuse = refuse or (lambda f: None)
        self.records, self.once = {}, {}
        self.paths = {}           # path -> {"cum", "got": set, "ts", "sport"}
        self.data = {}            # (msn, offset) -> payload
        self.arrivals = []        # (t, frame, fate)
        self.acks_sent = []       # (t, Mrh)
        self.silent_paths = set()
        self.conn = None
        self.owed = {}            # path -> (echo timestamp, source port): ACK due at flush()
        port.handlers.append(self.on_frame)

    def flush(self):
        owed, self.owed = self.owed, {}
        for p, (echo, sport) in owed.items():
            self.ack(p, echo, sport)

    def close(self):
        self.port.handlers.remove(self.on_frame)

    def state(self, p):
        return self.paths.setdefault(p, {"cum": 0, "got": set(), "ts": 0, "sport": 0})

    def mark(self, p, seq, floor=None):
        st = self.state(p)
        if floor is not None and w.seq_lt(st["cum"], floor):
            st["cum"] = floor
        new = not (w.seq_lt(seq, st["cum"]) or seq in st["got"])
        if new:
            st["got"].add(seq)
        while st["cum"] in st["got"]:
            st["got"].discard(st["cum"])
            st["cum"] = (st["cum"] + 1) & 0xffffffff
        st["got"] = {s for s in st["got"] if not w.seq_lt(s, st["cum"])}
        return new

    def ack(self, p, echo, sport, flags=0):
        st = self.state(p)
        sack = 0
        for s in st["got"]:
            i = w.seq_diff(s, st["cum"]) - 1
            if 0 <= i < w.SACK_BITS:
                sack |= 1 << i
        m = w.Mrh(opcode=w.ACK, flags=flags, conn_id=self.conn[0], token=self.conn[1],
                  path_id=p, path_count=self.conn[2], cum_seq=st["cum"], sack=sack,
                  echo_timestamp=echo, naks=self.records.get(p, [])[-4:] + self.once.pop(p, []))
        self.port.send_mrh(self.ip, sport, m)
        self.acks_sent.append((time.monotonic(), m))
        return m

    def on_frame(self, f, t):
        m = f.mrh
        if f.dst_ip != self.ip or not (m.is_data() or m.opcode == w.PROBE):
            return
        self.conn = (m.conn_id, m.token, m.path_count)
        if m.opcode == w.PROBE:
            # W§2.5: a probe applies its ack floor and elicits an ACK on its path echoing it,
            # from its source port (W§3.3), unless the test loses it.
            if self.drop(f) or m.path_id in self.silent_paths:
                self.arrivals.append((t, f, "probe"))
                return
            self.mark(m.path_id, (m.ack_floor - 1) & 0xffffffff, m.ack_floor)
            self.arrivals.append((t, f, "probe answered"))
            self.owed[m.path_id] = (m.timestamp, f.sport)
            return
        if self.drop(f):
            self.arrivals.append((t, f, "dropped"))
            return
        refused = self.refuse(f)
        if refused:
            syn, timer = refused
            record = (m.path_seq, m.src_stream, m.msn, syn, timer if syn == w.SYN_RNR else 0, 0)
            if syn == w.SYN_RNR:
                self.mark(m.path_id, (m.ack_floor - 1) & 0xffffffff, m.ack_floor)
                self.once.setdefault(m.path_id, []).append(record)
            else:
                self.mark(m.path_id, m.path_seq, m.ack_floor)
                self.records.setdefault(m.path_id, []).append(record)
            self.arrivals.append((t, f, f"refused {syn}"))
            self.owed[m.path_id] = (m.timestamp, f.sport)
            return
        new = self.mark(m.path_id, m.path_seq, m.ack_floor)
        if new and m.flags & w.F_FAILOVER:
            # C§4.3: the original's sequence is received too.
            new = self.mark(m.flags & w.F_ORIG_PATH, m.orig_seq)
        if new:
            self.data.setdefault((m.msn, m.offset), m.payload)
        st = self.state(m.path_id)
        st["ts"], st["sport"] = m.timestamp, f.sport
        self.arrivals.append((t, f, "new" if new else "duplicate"))
        if m.path_id not in self.silent_paths:
            self.owed[m.path_id] = (m.timestamp, f.sport)

    def message(self, msn, total):
        buf = bytearray(total)
        got = 0
        for (mm, off), pl in self.data.items():
            if mm == msn:
                buf[off:off + len(pl)] = pl
                got += len(pl)
        return bytes(buf), got


def iut_write(ctx, ip, size, seed, op="write", **qp_attrs):
    """The IUT posts a WRITE (or a SEND) of size bytes towards the tester at ip."""
    qp, qpn, stream = ctx.qp(ip, **qp_attrs)
    mr = ctx.mr(max(size, 64))
    data = pattern(size, seed)
    ctx.agent("write", mr=mr["mr"], offset=0, hex=data.hex())
    ctx.agent("post_send", qp=qp, op=op, mr=mr["mr"], offset=0, len=size, wr_id=seed,
              raddr=0x7000_0000, rkey=0x5eed)
    return qp, data


# --- the IUT as requester meeting NAKs (W§6.4, C§6) ---------------------------------------

WC_REM_ACCESS_ERR, WC_RNR_RETRY_EXC_ERR = 10, 13
RNR_TIMER_MS = {14: 1.28, 16: 2.56, 18: 5.12, 20: 10.24}   # verbs' encoding (C§6)


@check("nak_fails_the_message_once", "W§6.4 W§2.4 W§5.3")
def nak_fails_once(ctx):
    """The tester refuses the first packet of the IUT's 8-packet WRITE with NAK syndrome 2
    (remote access) and takes the rest: the WRITE completes once, with IBV_WC_REM_ACCESS_ERR,
    and none of its packets is sent again after the NAK (W§6.4: the message fails exactly once,
    its packets resolved and never retransmitted)."""
    s = "W§6.4"
    ip = ctx.new_ip()
    hit = {}

    def refuse(f):
        if not hit and f.mrh.is_data():
            hit.update(msn=f.mrh.msn, stream=f.mrh.src_stream)
            return (w.SYN_ACCESS, 0)
        return None
    rx = Receiver(ctx.port, ip, refuse=refuse)
    try:
        iut_write(ctx, ip, 8 * 1024, 95)
        wcs = ctx.wcs(2, 0.5)
        ctx.port.pump(0.1)
    finally:
        rx.close()
    expect(hit, "the IUT sent nothing", s)
    expect(len(wcs) == 1, f"the refused WRITE completed {len(wcs)} times: {wcs}", s)
    expect(wcs[0]["status"] == WC_REM_ACCESS_ERR,
           f"the WRITE refused with syndrome 2 completed with status {wcs[0]['status']}, want "
           f"IBV_WC_REM_ACCESS_ERR ({WC_REM_ACCESS_ERR})", s + " W§2.4")
    t_nak = next(t for t, a in rx.acks_sent if a.naks)
    again = [f for t, f, fate in rx.arrivals if f.mrh.is_data() and f.mrh.msn == hit["msn"] and
             (fate == "duplicate" or f.mrh.flags & w.F_FAILOVER) and t > t_nak + 0.01]
    expect(not again, f"a packet of the refused message was sent again 10 ms after the NAK: "
           f"{again[0].mrh if again else ''!r}", s)


@check("rnr_nak_waits_the_named_timer", "C§6 W§2.4 W§6.4")
def rnr_backoff(ctx):
    """The tester refuses the IUT's SEND with RNR naming timer code 18 (5.12 ms): the packet is
    sent again no earlier than that after the refusal reached the IUT (C§6; the IUT's
    timestamps mapped onto the tester's clock: a loaded host only delays it), nothing of it is
    copied meanwhile (excluded from RTO, SACK and tail probes), and once taken the SEND
    completes with its bytes. Every copy of the packet that arrives before the timer could have
    run from the first refusal is refused too: a copy the IUT sent before the refusal reached
    it (its RTO, 1 ms, beat a slow tester: sent, by its own clock, less than 0.5 ms after the
    tester answered) proves nothing and is passed over, and a correct IUT ignores its refusal
    (the packet already waits). The first copy that left later decides: after the timer ran
    out, the IUT waited; before it, the IUT did not wait if that copy was the first one, or if
    the window held more copies than RTO back-off sends in it (an IUT that resends at once on
    every refusal: it answers each refusal of a copy with another); a later copy among fewer is
    a slow IUT's RTO acting before the refusal did. An attempt where nothing decides is
    inconclusive, and it is run again (5 attempts). A copy too early in one attempt only is
    forgiven once (a sanitized build on a loaded host acting late on the refusal); an IUT that
    ignores the timer does it in every attempt, and the check fails at the second.
    A QP with rnr_retry 0 fails at the first refusal with IBV_WC_RNR_RETRY_EXC_ERR (C§6)."""
    s = "C§6"
    code = 18
    timer = RNR_TIMER_MS[code] / 1e3
    outcomes, violations = [], []
    for attempt in range(5):
        ip = ctx.new_ip()
        refused = []   # (when, frame): the first data packet, then its copies in the window

        def refuse(f, refused=refused):
            m = f.mrh
            if not m.is_data():
                return None
            now = time.monotonic()
            if refused:
                first = refused[0][1].mrh
                if (m.msn, m.offset) != (first.msn, first.offset) or \
                        now >= refused[0][0] + 0.95 * timer:
                    return None
            refused.append((now, f))
            return (w.SYN_RNR, 0x80 | code)
        rx = Receiver(ctx.port, ip, refuse=refuse)
        try:
            _, data = iut_write(ctx, ip, 512, 96 + 2 * attempt, op="send", rnr_retry=7)
            wcs = ctx.wcs(1, 3.0)
            ctx.port.pump(0.05)
        finally:
            rx.close()
        expect(refused, "the IUT sent nothing", s)
        first_frame = refused[0][1]
        first = first_frame.mrh
        t0 = next(t for t, f, fate in rx.arrivals if f is first_frame)
        nak_at = next((t for t, a in rx.acks_sent
                       if any(n[3] == w.SYN_RNR for n in a.naks)), None)
        expect(nak_at is not None, "the tester sent no RNR refusal", s)
        copies = [f for t, f, fate in rx.arrivals if f is not first_frame and f.mrh.is_data() and
                  f.mrh.msn == first.msn and f.mrh.offset == first.offset]
        expect(copies, "the SEND refused with RNR was never sent again", s)
        # The first transmission left no later than it arrived (t0), so copy k left no later
        # than t0 + gap_k on the tester's clock; the refusal reached the IUT no earlier than
        # the tester sent it (nak_at).
        sent = [(f, t0 + ((f.mrh.timestamp - first.timestamp) & 0xffffffff) / 1e9) for f in copies]
        crossed = [by for f, by in sent if by < nak_at + 0.5e-3]
        decided = next(((f, by) for f, by in sent if by >= nak_at + 0.5e-3), None)
        what = (f"{len(copies)} cop{'y' if len(copies) == 1 else 'ies'} after the first, "
                f"{len(crossed)} sent before the refusal could arrive (its timer "
                f"{RNR_TIMER_MS[code]} ms; the refusal sent {(nak_at - t0) * 1e3:.2f} ms after "
                f"the packet arrived)")
        if decided is None:
            outcomes.append(what)   # every copy may have crossed the refusal: inconclusive
            continue
        f, by = decided
        outcome = f"resent {(by - nak_at) * 1e3:.2f} ms after the refusal at the latest; " + what
        if by - nak_at < 0.95 * timer and f is not copies[0] and len(refused) - 1 < 8:
            # A later copy, early, but no more of them than RTO back-off (1, 2, 4 ms) sends in
            # the window, each resend perhaps doubled (a tail copy or a failover copy on another
            # path): a slow IUT still acting on the refusal. Inconclusive. One that resends at
            # once on every refusal sent 11-32 here.
            outcomes.append(outcome)
            continue
        if by - nak_at < 0.95 * timer:
            # Too early although the refusal had 0.5 ms to reach the IUT. An IUT that ignores
            # the timer does so every time; a slow but correct one (a sanitized build on a
            # loaded host taking longer than that to act on the refusal) rarely twice in a row.
            violations.append(outcome)
            expect(len(violations) < 2,
                   f"a packet refused with RNR (timer {RNR_TIMER_MS[code]} ms) was resent too "
                   f"early in 2 attempts: {violations}", s + " W§2.4")
            continue
        ctx.note(outcome + f"; attempt {attempt + 1}" +
                 (f", before: {outcomes + violations}" if outcomes or violations else ""))
        expect(len(wcs) == 1 and wcs[0]["status"] == WC_SUCCESS,
               f"the SEND taken after its RNR completed {wcs}", s)
        buf, got = rx.message(first.msn, len(data))
        expect(buf == data, f"the tester holds {got} of {len(data)} bytes, or different ones", s)
        break
    else:
        raise Skip(f"inconclusive: in no attempt was the refusal seen to be honoured, and in at "
                   f"most one was it seen ignored (a loaded host): {outcomes + violations}")
    # rnr_retry 0: the first refusal fails the message.
    ip = ctx.new_ip()
    rx = Receiver(ctx.port, ip, refuse=lambda f: (w.SYN_RNR, 0x80 | 14) if f.mrh.is_data() else None)
    try:
        iut_write(ctx, ip, 512, 97, op="send", rnr_retry=0)
        wcs = ctx.wcs(1, 3.0)
    finally:
        rx.close()
    expect(len(wcs) == 1 and wcs[0]["status"] == WC_RNR_RETRY_EXC_ERR,
           f"a SEND of a QP with rnr_retry 0 refused with RNR completed {wcs}, want "
           f"IBV_WC_RNR_RETRY_EXC_ERR ({WC_RNR_RETRY_EXC_ERR})", s)


# --- READ on the wire ----------------------------------------------------------------------

@check("read_request_answered_with_the_bytes", "W§2.2 W§4.1 W§5.3")
def read_request(ctx):
    """A READ_REQ of 3000 bytes (one packet, no payload, W§4.1) is ACKed and answered by
    READ_RESP packets carrying the request's msn and stream pair, offsets covering the
    3000 bytes with the IUT's memory, total_length 3000 and rsn 0 (W§2.2). A READ_REQ with a
    bad rkey is NAKed (syndrome 2) and answered with nothing."""
    s = "W§2.2 W§4.1"
    ip = ctx.new_ip()
    mr = ctx.mr(8192)
    content = pattern(3000, 98)
    ctx.agent("write", mr=mr["mr"], offset=100, hex=content.hex())
    _, qpn, stream = ctx.qp(ip)
    rx = Receiver(ctx.port, ip)
    d = Direction(ctx.port, ip, 2)
    try:
        mark = len(ctx.port.log)
        d.send(d.header(0, opcode=w.READ_REQ, dst_stream=qpn, src_stream=stream, msn=0,
                        total_length=3000, remote_addr=mr["addr"] + 100, rkey=mr["rkey"]))
        ctx.port.pump(2.0, until=lambda: rx.message(0, 3000)[1] >= 3000)
        expect(ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 1) is not None,
               f"the READ_REQ was not ACKed: {describe(d.acks(mark))}", "W§5.2")
        resp = [f.mrh for t, f, fate in rx.arrivals if f.mrh.is_data()]
        expect(resp, "no READ_RESP came back", s)
        for m in resp:
            expect(m.opcode == w.READ_RESP and m.msn == 0 and m.dst_stream == stream and
                   m.src_stream == qpn and m.total_length == 3000 and m.rsn == 0,
                   f"answer {m!r}: want READ_RESP, msn 0, stream {qpn:#x}->{stream:#x}, "
                   f"total_length 3000, rsn 0", s)
        buf, got = rx.message(0, 3000)
        expect(got == 3000 and buf == content,
               f"READ_RESP payloads cover {got} of 3000 bytes, or differ from the IUT's memory", s)
        # A bad rkey: NAK, no answer.
        _, qpn2, stream2 = ctx.qp(ip)
        n = len(rx.arrivals)
        mark = len(ctx.port.log)
        d.send(d.header(1, opcode=w.READ_REQ, dst_stream=qpn2, src_stream=stream2, msn=0,
                        total_length=64, remote_addr=mr["addr"], rkey=mr["rkey"] ^ 0x00555500))
        f = ctx.wait_ack(d, mark, 1, lambda a: bool(a.naks))
        expect(f is not None and f.mrh.naks[0][3] == w.SYN_ACCESS,
               f"a READ_REQ with a bad rkey: {describe(d.acks(mark))}; want NAK syndrome 2",
               "W§5.3 W§2.4")
        ctx.port.pump(0.1)
        answers = [f for t, f, fate in rx.arrivals[n:] if f.mrh.is_data() and
                   f.mrh.dst_stream == stream2]
        expect(not answers, f"a refused READ_REQ was answered: {answers[0].mrh if answers else ''!r}",
               "W§5.3")
    finally:
        rx.close()


@check("atomic_write_stored_whole_in_message_order", "W§2.2 W§5.3 W§2.4")
def atomic_write(ctx):
    """An ATOMIC_WRITE (opcode 12, W§2.2) that arrives before the WRITE sent ahead of it in its
    stream is ACKed but not stored; once the WRITE is in place both are, the 8 bytes exactly as
    they travelled (no byte order applied). A copy seen again stores nothing (the IUT's
    application changed the word meanwhile). A misaligned target is NAKed with syndrome 4
    (kRemoteInvalid) and nothing is written."""
    s = "W§2.2"
    ip = ctx.new_ip()
    mr = ctx.mr(4096, 0)
    _, qpn, stream = ctx.qp(ip)
    d = Direction(ctx.port, ip, 2)
    open_direction(ctx, d, qpn, stream, mr, 1024, 11)  # msn 0
    flag = bytes(range(1, 9))
    data = pattern(256, 12)

    def aw(msn, at, path=1):
        return d.header(path, opcode=w.ATOMIC_WRITE, dst_stream=qpn, src_stream=stream, msn=msn,
                        offset=0, total_length=8, remote_addr=mr["addr"] + at, rkey=mr["rkey"],
                        payload=flag)

    def settle(at, want, timeout=1.0):
        """The IUT's 8 bytes at `at` once they equal want, or as they are after timeout."""
        end = time.monotonic() + timeout
        while True:
            got = ctx.mem(mr, at, 8)
            if got == want or time.monotonic() > end:
                return got
            ctx.port.pump(0.02)

    first = aw(2, 0)
    mark = len(ctx.port.log)
    d.send(first)  # msn 2 overtakes msn 1
    expect(ctx.wait_ack(d, mark, 1, lambda a: a.cum_seq == 1) is not None,
           f"the ATOMIC_WRITE got no ACK: {describe(d.acks(mark))}", "W§5.2")
    ctx.port.pump(0.1)
    got = ctx.mem(mr, 0, 8)
    expect(got == bytes(8), f"the ATOMIC_WRITE (msn 2) was stored, {got.hex()}, before the "
           "WRITE of msn 1 arrived", s)
    mark = len(ctx.port.log)
    d.send(write_pkt(d, 0, qpn, stream, 1, mr, 256, data))
    expect(ctx.wait_ack(d, mark, 0, lambda a: a.cum_seq == 2) is not None,
           f"the WRITE got no ACK: {describe(d.acks(mark))}", "W§5.2")
    got = settle(0, flag)
    expect(got == flag, f"the ATOMIC_WRITE left {got.hex()}, want {flag.hex()} as it travelled", s)
    expect(ctx.mem(mr, 256, 256) == data, "the WRITE ahead of it did not land", "W§5.1")
    expect(ctx.mem(mr, 8, 8) == bytes(8), "the ATOMIC_WRITE wrote past its 8 bytes", s)
    # A copy (a new packet of the same message): ACKed, not stored again.
    ctx.agent("write", mr=mr["mr"], offset=0, hex="ee" * 8)
    mark = len(ctx.port.log)
    d.send(aw(2, 0))
    expect(ctx.wait_ack(d, mark, 1, lambda a: a.cum_seq == 2) is not None,
           f"the copy of the ATOMIC_WRITE was not ACKed: {describe(d.acks(mark))}", "W§5.1")
    ctx.port.pump(0.1)
    got = ctx.mem(mr, 0, 8)
    expect(got == b"\xee" * 8, f"a copy of an ATOMIC_WRITE seen again was stored: {got.hex()}",
           "W§2.2 W§5.1")
    # Misaligned: NAK kRemoteInvalid, nothing written (on path 0, where nak_case listens).
    m = aw(3, 12, path=0)
    nak_case(ctx, d, qpn, stream, mr, m.path_seq, m, w.SYN_INVALID, "misaligned ATOMIC_WRITE")
    got = ctx.mem(mr, 8, 16)
    expect(got == bytes(16), f"a misaligned ATOMIC_WRITE wrote {got.hex()}", s)


# --- (g) the IUT as sender: SACK hole -> one retransmission -------------------------------------

@check("sack_hole_retransmits_exactly_the_missing_packet", "W§6.2 W§6.3 C§1")
def sack_retransmit(ctx):
    """The IUT WRITEs 24 packets; the tester loses the first transmission of the fifth (one
    that has later packets of its path in the same burst) and ACKs everything else at once. The
    ACK of the next packet on that path shows the hole; the IUT then resends exactly that
    packet, on the same path with the same sequence, not as a failover copy (W§6.2:
    retransmitted at once; a SACK hole is no reason to suspect the path, C§1), with the same
    bytes, and resends nothing else; the WRITE completes. The delay from the hole's ACK to the
    resend is reported (the resend's send time from the IUT's own timestamps, mapped onto the
    tester's clock by the earliest arrival); a resend decided before the hole's ACK could have
    arrived (the IUT's RTO beat a slow tester) makes the attempt inconclusive, and it is run
    again (5 attempts)."""
    s = "W§6.2"
    outcomes, slow = [], []
    for attempt in range(5):
        ip = ctx.new_ip()
        target = {}
        seen = []

        def drop(f, target=target, seen=seen):
            m = f.mrh
            if not m.is_data() or target:
                return False
            seen.append(1)
            if len(seen) == 5:
                target.update(path=m.path_id, seq=m.path_seq, msn=m.msn, offset=m.offset)
                return True
            return False
        rx = Receiver(ctx.port, ip, drop)
        try:
            size = 24 * 1024
            _, data = iut_write(ctx, ip, size, 40 + attempt)
            wcs = ctx.wcs(1, 5.0)
            ctx.port.pump(0.05)
        finally:
            rx.close()
        if not target:
            raise Fail(f"the IUT sent fewer than 5 data packets of a 24 KiB WRITE towards {ip} ({s})")
        p, seq = target["path"], target["seq"]
        # The IUT's send times on the tester's clock: its timestamps (W§2.1: ns, low 32 bits)
        # plus the smallest (arrival - timestamp) of the attempt, so never before the truth.
        # The tester's lag, how much later than that a packet was taken, says whether the IUT's
        # timers could rightly fire before the tester answered (rto_initial is 1 ms).
        data_pkts = [(t, f) for t, f, _ in rx.arrivals if f.mrh.is_data()]
        ts0 = data_pkts[0][1].mrh.timestamp
        rel = {id(f): ((f.mrh.timestamp - ts0) & 0xffffffff) / 1e9 for _, f in data_pkts}
        offset = min(t - rel[id(f)] for t, f in data_pkts)
        lag = max(t - rel[id(f)] - offset for t, f in data_pkts)
        slow.append(lag > 0.5e-3)
        hole_ack = next((t for t, a in rx.acks_sent if a.path_id == p and
                         w.seq_lt(a.cum_seq, seq + 1) and a.sack), None)
        if hole_ack is None:
            outcomes.append(f"no packet followed the lost one on its path (tester lag "
                            f"{lag * 1e3:.2f} ms)")
            continue

        def is_target(m):
            return m.is_data() and m.msn == target["msn"] and m.offset == target["offset"]
        resends = [(t, f) for t, f, fate in rx.arrivals if fate != "dropped" and is_target(f.mrh)]
        if not resends:
            raise Fail(f"the lost packet (path {p}, sequence {seq}) was never resent ({s})")
        t1, first = resends[0]
        sent_at = rel[id(first)] + offset
        delay = sent_at - hole_ack
        others = [f for t, f, fate in rx.arrivals if f.mrh.is_data() and not is_target(f.mrh) and
                  (fate == "duplicate" or f.mrh.flags & w.F_FAILOVER)]
        m = first.mrh
        how = f"path {m.path_id} seq {m.path_seq}{' failover copy' if m.flags & w.F_FAILOVER else ''}"
        same_path = m.path_id == p and m.path_seq == seq and not m.flags & w.F_FAILOVER
        if not same_path or others:
            outcome = (f"first resend as {how} {delay * 1e3:.2f} ms after the hole's ACK, "
                       f"{len(others)} other packets resent, tester lag {lag * 1e3:.2f} ms")
            if others:
                o = others[0]
                outcome += (f" (first: {o.mrh!r}, sent {(rel[id(o)] + offset - hole_ack) * 1e3:.2f}"
                            f" ms after the hole's ACK)")
            if delay > 10e-3 and not same_path:
                # The IUT had the hole's ACK for 10 ms and did not resend on the path.
                raise Fail(f"{outcome}: the lost packet (path {p}, sequence {seq}) was not "
                           f"retransmitted at once on its path ({s})")
            outcomes.append(outcome)   # its RTO came first (a slow tester): inconclusive
            continue
        expect(m.payload == data[target["offset"]:target["offset"] + len(m.payload)],
               "the resend's bytes differ from the packet's", s)
        expect(delay <= RTO_MAX_S, f"resent {delay * 1e3:.1f} ms after the ACK showing the hole; "
               f"'at once' cannot take longer than an RTO (rto_max {RTO_MAX_S * 1e3:.0f} ms)", s)
        expect(len(wcs) == 1 and wcs[0]["status"] == WC_SUCCESS,
               f"the IUT's WRITE completed {wcs}", "W§4.2")
        buf, got = rx.message(target["msn"], size)
        expect(buf == data, f"the tester received {got} of {size} bytes, or different ones", "W§4.1")
        ctx.note(f"resent {max(delay, 0) * 1e6:.0f} µs after the ACK that showed the hole "
                 f"(path {p}, sequence {seq}; arrived {(t1 - hole_ack) * 1e6:.0f} µs after it); "
                 f"attempt {attempt + 1}" + (f", before: {outcomes}" if outcomes else ""))
        return
    if all(slow):
        # Every attempt had the tester answering later than the IUT's timers may wait: nothing
        # can be concluded on this host now; said so rather than passed or failed.
        raise Skip(f"inconclusive: in every attempt the tester took some packet more than 0.5 ms "
                   f"late (a loaded host), so the IUT's timers could rightly act first: {outcomes}")
    raise Fail(f"no attempt showed a clean SACK retransmission: {outcomes} ({s})")


# --- (h) failover on a silent path ----------------------------------------------------------

@check("silent_path_fails_over_and_probes", "C§4.1 C§4.2 C§4.4 W§2.2 W§2.5 W§3.3")
def failover(ctx):
    """The tester never answers one path of the IUT's (its packets are lost, no ACK) and ACKs
    the others. The IUT declares it failed (C§4.1) and resends its packets on other paths as
    failover copies: kFlagFailoverCopy, the silent path's id in the flag bits, orig_seq its
    sequence there, same bytes (C§4.2, W§2.2), never on the silent path again while it is
    failed (a redundant copy of one of its packets, C§5.2, says only that the packet was resent
    on the path, still in service); it probes the path with PROBEs (32 bytes, path_seq its next sequence) from new
    random source ports in [49152, 65535] (C§4.4, W§2.5). The WRITE completes with every byte
    right. Once the tester answers a probe (an ACK echoing it, from the probe's port), the path
    returns to service and carries data again from the probe's port (C§4.4, W§3.3)."""
    ip = ctx.new_ip()
    dead = {}                    # the silent path: its id, first port, first packet's time, msn
    # Every probe's port, in order, from the first write to the end: a probe can leave between
    # the phases' two receivers, and the path may come back under its port (W§3.3).
    probe_ports = []

    def watch(f, t):
        if f.dst_ip == ip and f.mrh.opcode == w.PROBE and f.mrh.path_id == dead.get("path"):
            probe_ports.append(f.sport)
    ctx.port.handlers.append(watch)
    try:
        failover_phases(ctx, ip, dead, probe_ports)
    finally:
        ctx.port.handlers.remove(watch)


def failover_phases(ctx, ip, dead, probe_ports):
    s = "C§4.1 C§4.2 C§4.4"
    # (msn, offset) -> its sequences on the dead path: before failing, the path may carry a
    # packet more than once (a resend in place keeps its sequence; a redundant or failover
    # copy of another path's packet takes a new one, C§5.2).
    orig = {}

    def drop(f):
        m = f.mrh
        if not dead and not m.is_data():
            return False
        if not dead:
            dead["path"] = m.path_id
            dead["sport"] = f.sport
            dead["t"] = time.monotonic()
            dead["msn"] = m.msn
        if m.path_id == dead["path"] and not dead.get("answered"):
            if m.is_data():
                orig.setdefault((m.msn, m.offset), set()).add(m.path_seq)
            return True
        return False
    rx = Receiver(ctx.port, ip, drop)
    try:
        size = 32 * 1024
        _, data = iut_write(ctx, ip, size, 60)
        wcs = ctx.wcs(1, 10.0)
        # Probes continue while the path is failed; wait for one more to answer.
        ctx.port.pump(0.3, until=lambda: any(fate == "probe" and f.mrh.path_id == dead["path"]
                                             for _, f, fate in rx.arrivals))
    finally:
        rx.close()
    expect(dead, f"the IUT sent no data towards {ip}", s)
    p = dead["path"]
    expect(len(wcs) == 1 and wcs[0]["status"] == WC_SUCCESS,
           f"the WRITE over a silent path completed {wcs} (want success: other paths work)", s)
    buf, got = rx.message(dead["msn"], size)
    expect(buf == data, f"the tester holds {got} of {size} bytes, or different ones", "C§4.2")
    copies = [(t, f) for t, f, fate in rx.arrivals if f.mrh.is_data() and f.mrh.flags & w.F_FAILOVER
              and (f.mrh.flags & w.F_ORIG_PATH) == p]
    expect(copies, f"no failover copy of path {p}'s packets", "C§4.2")
    for t, f in copies:
        m = f.mrh
        expect(m.path_id != p, f"a failover copy on the failed path itself: {m!r}", "C§4.2")
        want = orig.get((m.msn, m.offset), set())
        expect(m.orig_seq in want,
               f"copy {m!r}: orig_seq {m.orig_seq}, the packet was sequence {sorted(want)} on "
               f"path {p}",
               "C§4.2 W§2.2")
        expect(m.payload == data[m.offset:m.offset + len(m.payload)], "a copy's bytes differ", "C§4.2")
    # A redundant copy (C§5.2, kFlagRedundant) of a path's packet says only that the packet was
    # resent on its own path, which is still in service; the first failover copy proper says
    # the path has failed.
    moved = [(t, f) for t, f in copies if not f.mrh.flags & w.F_REDUNDANT]
    expect(moved, f"only redundant copies of path {p}'s packets ({len(copies)}): it never failed "
           f"over", "C§4.1 C§4.2")
    after_fail = [f for t, f, fate in rx.arrivals if f.mrh.is_data() and f.mrh.path_id == p and
                  t > moved[0][0] and f.sport == dead["sport"]]
    expect(not after_fail, f"data on the failed path after its copies left: "
           f"{after_fail[0].mrh if after_fail else ''!r} (first copy: {moved[0][1].mrh!r})",
           "C§4.1 C§4.2")
    probes = [(t, f) for t, f, fate in rx.arrivals if fate == "probe" and f.mrh.path_id == p]
    expect(probes, f"path {p} was never probed", "C§4.4")
    early = sum(1 for t, f in copies if t < moved[0][0])
    ctx.note(f"path {p}: first failover copy {1e3 * (moved[0][0] - dead['t']):.1f} ms after its "
             f"first packet, first probe {1e3 * (probes[0][0] - dead['t']):.1f} ms; {len(copies)} "
             f"copies ({len(copies) - len(moved)} redundant, {early} before it failed), "
             f"{len(probes)} probes")
    ports = set()
    for t, f in probes:
        m = f.mrh
        expect(49152 <= f.sport <= 65535 and f.sport != dead["sport"],
               f"probe from UDP port {f.sport}: want a new one in [49152, 65535] (was "
               f"{dead['sport']})", "C§4.4 W§3.3")
        expect(len(f.udp_payload) == 32, f"PROBE of {len(f.udp_payload)} bytes", "W§2.5")
        ports.add(f.sport)
    nxt = max(max(v) for v in orig.values()) + 1 if orig else 0
    expect(probes[-1][1].mrh.path_seq == nxt,
           f"PROBE path_seq {probes[-1][1].mrh.path_seq}: the path's next sequence is {nxt}", "W§2.5")
    # Answer the newest probe: an ACK on the path, echoing it, from its port; the path returns.
    t_probe, pf = probes[-1]
    dead["answered"] = True
    rx = Receiver(ctx.port, ip)
    rx.conn = (pf.mrh.conn_id, pf.mrh.token, pf.mrh.path_count)
    rx.state(p)["cum"] = pf.mrh.ack_floor
    rx.ack(p, pf.mrh.timestamp, pf.sport)
    try:
        ctx.port.pump(0.05)
        qp, data2 = iut_write(ctx, ip, size, 61)
        wcs = ctx.wcs(1, 10.0)
        ctx.port.pump(0.05)
    finally:
        rx.close()
    expect(len(wcs) == 1 and wcs[0]["status"] == WC_SUCCESS, f"the second WRITE completed {wcs}",
           s)
    back = [f for t, f, fate in rx.arrivals if f.mrh.is_data() and f.mrh.path_id == p and
            not f.mrh.flags & w.F_FAILOVER]
    expect(back, f"path {p} carried no data after its probe was answered", "C§4.4")
    # The path keeps the port it was probed under (W§3.3): the answered probe's, or a later
    # probe's if one left before the answer arrived.
    expect(all(f.sport in probe_ports[probe_ports.index(pf.sport):] for f in back),
           f"path {p} back in service from port {back[0].sport}: not a port it was probed under "
           f"since the answered probe ({probe_ports}; its port before failing: {dead['sport']})",
           "C§4.4 W§3.3")


# --- RTO, back-off and retry exhaustion ------------------------------------------------------

@check("silent_peer_rto_backoff_and_retry_exceeded", "W§6.3 W§6.4 C§4.5")
def silent_peer(ctx):
    """The tester answers nothing: the IUT's one-packet WRITE is retransmitted (original, then
    failover copies and resends) with intervals, by the IUT's own timestamps, never below
    rto_min (W§6.3), and fails with IBV_WC_RETRY_EXC_ERR once silent for the QP's timeout x
    (retry_cnt + 1), neither earlier nor later than that plus rto_max and slack (W§6.4,
    C§4.5)."""
    s = "W§6.3 W§6.4 C§4.5"
    ip = ctx.new_ip()
    timeout_code, retry = 12, 3                # 4.096 µs x 2^12 = 16.8 ms: 3 expiries in 7 ms
    tmo = 4.096e-6 * 2 ** timeout_code
    seen = []

    def on(f, t):
        if f.dst_ip == ip and f.mrh.is_data():
            seen.append((t, f))
    ctx.port.handlers.append(on)
    try:
        t0 = time.monotonic()
        iut_write(ctx, ip, 512, 80, timeout=timeout_code, retry_cnt=retry)
        wcs = ctx.wcs(1, 10.0)
        t1 = time.monotonic()
    finally:
        ctx.port.handlers.remove(on)
    expect(len(wcs) == 1, "the WRITE to a silent peer never completed", s)
    expect(wcs[0]["status"] == WC_RETRY_EXC_ERR,
           f"the WRITE to a silent peer completed with status {wcs[0]['status']}, want "
           f"RETRY_EXC_ERR ({WC_RETRY_EXC_ERR})", "W§6.4")
    expect(seen, "no packet reached the tester", s)
    elapsed = t1 - seen[0][0]
    # Transmissions within 50 µs of each other (IUT clock) are one expiry's: a resend and its
    # redundant copy (C§5.2), or a packet moved off a suspected path.
    stamps = [seen[0][1].mrh.timestamp]
    for _, f in seen[1:]:
        if ((f.mrh.timestamp - stamps[-1]) & 0xffffffff) > 50_000:
            stamps.append(f.mrh.timestamp)
    gaps = [((b - a) & 0xffffffff) / 1e9 for a, b in zip(stamps, stamps[1:])]
    ctx.note(f"{len(seen)} transmissions: " + ", ".join(
        f"path {f.mrh.path_id}/{f.mrh.path_seq}{' copy' if f.mrh.flags & w.F_FAILOVER else ''}"
        for _, f in seen) + f"; gaps between expiries (IUT clock) "
             f"{[round(g * 1e3, 2) for g in gaps]} ms; error after {elapsed * 1e3:.0f} ms "
             f"(timeout {tmo * 1e3:.1f} ms x {retry + 1})")
    expect(all(g >= RTO_MIN_S * 0.95 for g in gaps),
           f"a retransmission {min(gaps) * 1e6:.0f} µs after the previous one, below rto_min", s)
    # No ACK ever came, so every timer is rto_initial backed off once more per expiry while the
    # peer stays silent (W§6.3: "doubled per back-off step"; the packet carries its back-off to
    # the path it moves to). A loaded host only makes gaps longer: the lower bound is firm.
    for k, g in enumerate(gaps):
        want = min(ctx.rto_initial * 2 ** k, RTO_MAX_S)
        expect(g >= 0.9 * want, f"expiry {k + 1} came {g * 1e3:.2f} ms after the previous "
               f"transmission; with the peer silent the back-off makes it >= {want * 1e3:.1f} ms "
               f"(gaps {[round(x * 1e3, 2) for x in gaps]} ms)", "W§6.3")
    expect(elapsed >= tmo * (retry + 1) * 0.9,
           f"RETRY_EXC after {elapsed * 1e3:.1f} ms of silence, before timeout x (retry_cnt + 1)"
           f" = {tmo * (retry + 1) * 1e3:.1f} ms", s)
    expect(elapsed <= tmo * (retry + 1) + RTO_MAX_S + 1.0,
           f"RETRY_EXC only after {elapsed * 1e3:.0f} ms; due by timeout x (retry_cnt + 1) = "
           f"{tmo * (retry + 1) * 1e3:.0f} ms plus an RTO", s)


# --- multicast datagrams (W§8) -----------------------------------------------------------------

GROUP = "230.18.77.8"       # an IPv4 group; the veth and its namespace are the test's own
QKEY = 0x1357_2468          # high bit clear: the WR's own Q_Key, not the QP's


@check("group_datagram_sent_once_as_specified", "W§8")
def group_datagram(ctx):
    """UD SENDs to a group's IPv4-mapped GID (remote QPN 0xffffff) leave as datagrams (W§8),
    one each: to the group's IPv4 and Ethernet address, Not-ECT, from one UDP source port
    0xc000 | 14 bits for all of the QP's datagrams, the 80-byte header with every connection
    field zero (checked on arrival, tester.Port), dst_stream 0xffffff, src_stream the QP, rkey
    the Q_Key, DATAGRAM_IMM with the immediate data only where posted with one, msn counting
    the QP's datagrams, total_length = payload_len = the bytes posted. Nothing answers a
    datagram and none is sent again; every WQE completes successfully. Skipped where the
    device offers no multicast (max_mcast_grp 0, verbs-mapping.md §7)."""
    s = "W§8"
    if not ctx.agent("device")["max_mcast_grp"]:
        raise Skip("the IUT's device offers no multicast (max_mcast_grp 0)")
    mr = ctx.mr(4096)
    posts = [(0, 1, None), (64, 64, None), (1024, 1000, 0x0a0b0c0d), (2048, 0, None),
             (3072, 700, 0)]
    data = {}
    for k, (at, n, _) in enumerate(posts):
        data[k] = pattern(n, 40 + k)
        if n:
            ctx.agent("write", mr=mr["mr"], offset=at, hex=data[k].hex())
    qp = ctx.agent("ud_qp", qkey=QKEY)
    mark = len(ctx.port.log)

    def sent():
        return ctx.port.frames_since(mark, lambda f: f.dst_ip == GROUP)
    for k, (at, n, imm) in enumerate(posts):
        ctx.agent("ud_send", qp=qp["qp"], group=GROUP, mr=mr["mr"], offset=at, len=n,
                  wr_id=700 + k, qkey=QKEY, imm=imm)
    ctx.port.pump(3.0, until=lambda: len(sent()) >= len(posts))
    wcs = ctx.wcs(len(posts), 3.0)
    ctx.port.pump(0.5)   # long enough for any retransmission timer (W§7: rto_initial 1 ms)
    got = sent()
    ctx.agent("destroy_qp", qp=qp["qp"])
    expect(sorted(c["wr_id"] for c in wcs) == [700 + k for k in range(len(posts))] and
           all(c["status"] == WC_SUCCESS for c in wcs),
           f"the group SENDs completed as {wcs}, want {len(posts)} successes", "verbs-mapping §7")
    expect(len(got) == len(posts), f"{len(posts)} datagrams posted, {len(got)} frames to "
           f"{GROUP}: {[repr(f.mrh) for f in got]} (each is sent once)", s)
    ports = {f.sport for f in got}
    expect(len(ports) == 1, f"one QP's datagrams came from UDP ports {sorted(ports)}", s)
    msn0 = got[0].mrh.msn
    for k, ((at, n, imm), f) in enumerate(zip(posts, got)):
        m = f.mrh
        want_op = w.DATAGRAM if imm is None else w.DATAGRAM_IMM
        expect(m.opcode == want_op, f"datagram {k}: opcode {m.opcode}, want {want_op}", s)
        expect(m.src_stream == qp["qpn"], f"datagram {k}: src_stream {m.src_stream:#x}, the "
               f"sending QP is {qp['qpn']:#x}", s)
        expect(m.rkey == QKEY, f"datagram {k}: rkey {m.rkey:#x}, the Q_Key is {QKEY:#x}", s)
        if imm is not None:
            # verbs hands imm_data in network order: the wire carries its bytes as they are.
            want_imm = socket.htonl(imm)
            expect(m.imm == want_imm, f"datagram {k}: imm {m.imm:#010x}, want {want_imm:#010x}", s)
        expect(m.msn == (msn0 + k) & 0xffffffff, f"datagram {k}: msn {m.msn}, the QP's "
               f"datagrams so far say {(msn0 + k) & 0xffffffff}", s)
        expect(m.payload == data[k], f"datagram {k}: {len(m.payload)} payload bytes differ from "
               f"the {n} posted", s)
    ctx.note(f"{len(got)} datagrams to {GROUP} from port {got[0].sport:#x}, msn {msn0}.."
             f"{got[-1].mrh.msn}")


MEMBER_GROUP = "230.18.77.9"    # the group the IUT joins; OTHER_GROUP has no member there
OTHER_GROUP = "230.18.77.10"
WC_RECV = 128                   # IBV_WC_RECV


@check("group_member_reports_and_receives_as_specified", "W§8")
def group_member(ctx):
    """The IUT as a group member (W§8). A UD QP joins a group through the RDMA CM, as
    applications join: the device sends an IGMPv2 Membership Report to the group (TTL 1, the
    Router Alert option, DSCP CS6, from its address, both checksums right). A general query and
    a query for the group are answered with a report of it; a query for a group it has no
    member in gets no report of that group. Datagrams to the group with the Q_Key of the join
    are delivered to the member in the order sent, each in the next receive: a 40-byte GRH (20
    zero bytes, then an IPv4 header from the sender to the group) and the payload, the sender's
    QP as src_qp, DATAGRAM_IMM with its immediate data. Interleaved with them, and delivered
    nowhere: one with another Q_Key, one with a connection field not zero (dropped as
    malformed, counted mcast_rx_malformed where the IUT publishes counters) and one to a group
    without a member there. When the member leaves, the device sends a Leave Group for the
    group to 224.0.0.2. Skipped where the device offers no multicast (max_mcast_grp 0)."""
    s = "W§8"
    if not ctx.agent("device")["max_mcast_grp"]:
        raise Skip("the IUT's device offers no multicast (max_mcast_grp 0)")
    port = ctx.port
    src = ctx.new_ip()
    have_counters = ctx.counters.available()
    before = ctx.counters.read() if have_counters else None

    def igmp_since(mark, kind, group):
        return [f for f in port.igmp[mark:] if f.igmp_type == kind and f.igmp_group == group]

    def as_a_host_sends(f, what, dst):
        expect(f.dst_ip == dst, f"{what} to {f.dst_ip}, not {dst}", s)
        expect(f.ttl == 1, f"{what} with TTL {f.ttl}, not 1", s)
        expect(f.router_alert, f"{what} without the Router Alert option (RFC 2113)", s)
        expect(f.tos >> 2 == w.DSCP_CS6, f"{what} with DSCP {f.tos >> 2}, not CS6", s)
        expect(f.ip_csum_ok and f.igmp_csum_ok, f"{what} with a wrong checksum", s)

    mark = len(port.igmp)
    member = ctx.agent("join", ip=port.iut_ip, group=MEMBER_GROUP, recvs=8)
    port.pump(3.0, until=lambda: igmp_since(mark, w.IGMP_REPORT, MEMBER_GROUP))
    reports = igmp_since(mark, w.IGMP_REPORT, MEMBER_GROUP)
    expect(reports, f"no Membership Report for {MEMBER_GROUP} within 3 s of the join", s)
    as_a_host_sends(reports[0], "the Membership Report", MEMBER_GROUP)

    def query(group, dst):
        port.send(w.ether(w.group_mac(dst), port.mac, w.ETH_IPV4,
                          w.ipv4_igmp(src, dst, w.igmp(w.IGMP_QUERY, group))))

    mark = len(port.igmp)
    query(OTHER_GROUP, OTHER_GROUP)
    port.pump(0.3)
    expect(not igmp_since(mark, w.IGMP_REPORT, OTHER_GROUP),
           f"a report for {OTHER_GROUP}, which has no member on the IUT", s)
    for group, dst, what in (("0.0.0.0", w.ALL_HOSTS, "general query"),
                             (MEMBER_GROUP, MEMBER_GROUP, f"query for {MEMBER_GROUP}")):
        mark = len(port.igmp)
        query(group, dst)
        port.pump(2.0, until=lambda: igmp_since(mark, w.IGMP_REPORT, MEMBER_GROUP))
        got = igmp_since(mark, w.IGMP_REPORT, MEMBER_GROUP)
        expect(got, f"the {what} was not answered with a report of {MEMBER_GROUP} within 2 s", s)
        as_a_host_sends(got[0], f"the report answering the {what}", MEMBER_GROUP)

    qkey, sender_qp, sport = member["qkey"], 0x4242, 0xc000 | 0x123

    def datagram(k, payload, imm=None, group=MEMBER_GROUP, **kw):
        m = w.Mrh(opcode=w.DATAGRAM if imm is None else w.DATAGRAM_IMM, conn_id=0,
                  dst_stream=w.MCAST_QPN, src_stream=sender_qp, msn=k, rkey=qkey,
                  imm=imm or 0, total_length=len(payload), payload=payload)
        m.__dict__.update(kw)
        port.send(w.ether(w.group_mac(group), port.mac, w.ETH_IPV4,
                          w.ipv4_udp(src, group, sport, w.UDP_PORT, m.encode(), tos=0)))

    good = [(pattern(1, 61), None), (pattern(100, 62), None), (pattern(1000, 63), 0x01020304),
            (b"", None)]
    datagram(0, good[0][0])
    datagram(1, b"another Q_Key", rkey=qkey ^ 1)
    datagram(2, good[1][0])
    datagram(3, b"a connection field", conn_id=7)
    datagram(4, good[2][0], imm=good[2][1])
    datagram(5, b"no member here", group=OTHER_GROUP)
    datagram(6, good[3][0])
    out, end = [], time.monotonic() + 3.0
    while len(out) < len(good) and time.monotonic() < end:
        out += ctx.agent("member_poll", member=member["member"], max=8, wait_ms=20)["wcs"]
    port.pump(0.3)
    out += ctx.agent("member_poll", member=member["member"], max=8)["wcs"]
    expect(len(out) == len(good), f"{len(good)} datagrams to the group were deliverable, the "
           f"member received {len(out)}: {[(c['status'], c['len']) for c in out]}", s)
    for k, ((data, imm), c) in enumerate(zip(good, out)):
        what = f"delivery {k}"
        expect(c["status"] == WC_SUCCESS and c["opcode"] == WC_RECV,
               f"{what}: status {c['status']}, opcode {c['opcode']}", "verbs-mapping §7")
        expect(c["len"] == 40 + len(data), f"{what}: byte_len {c['len']}, want 40 + "
               f"{len(data)} (the datagrams arrived in order?)", "verbs-mapping §7")
        got = bytes.fromhex(c["hex"])
        grh, ip = got[:20], got[20:40]
        expect(grh == bytes(20) and ip[0] >> 4 == 4 and ip[9] == 17 and
               socket.inet_ntoa(ip[12:16]) == src and socket.inet_ntoa(ip[16:20]) == MEMBER_GROUP,
               f"{what}: the GRH {got[:40].hex()} is not 20 zero bytes and an IPv4 header from "
               f"{src} to {MEMBER_GROUP}", "verbs-mapping §7")
        expect(got[40:] == data, f"{what}: the payload differs from the {len(data)} bytes sent", s)
        expect(c["src_qp"] == sender_qp, f"{what}: src_qp {c['src_qp']:#x}, the sender's QP is "
               f"{sender_qp:#x}", "verbs-mapping §7")
        want_imm = None if imm is None else socket.htonl(imm)
        expect(c["imm"] == want_imm, f"{what}: immediate data {c['imm']}, want {want_imm}", s)
    if have_counters and "mcast_rx_malformed" in before:
        moved = ctx.counter_deltas(before, lambda d: d.get("mcast_rx_malformed", 0) >= 1)
        expect(moved.get("mcast_rx_malformed", 0) == 1, f"the datagram with a connection field "
               f"moved mcast_rx_malformed by {moved.get('mcast_rx_malformed', 0)}, not 1", s)

    mark = len(port.igmp)
    ctx.agent("leave", member=member["member"])
    port.pump(3.0, until=lambda: igmp_since(mark, w.IGMP_LEAVE, MEMBER_GROUP))
    leaves = igmp_since(mark, w.IGMP_LEAVE, MEMBER_GROUP)
    expect(leaves, f"no Leave Group for {MEMBER_GROUP} within 3 s of the member leaving", s)
    as_a_host_sends(leaves[0], "the Leave Group", w.ALL_ROUTERS)
    ctx.note(f"joined {MEMBER_GROUP} as QP {member['qpn']:#x} (Q_Key {qkey:#x}); "
             f"{len(out)} of 7 datagrams delivered, as due; report, 2 answers and leave seen")
