# SPDX-License-Identifier: Apache-2.0
"""MetaRoCE version 1 packets, encoded and decoded from docs/spec/wire.md and link.md alone.

Written from the spec text, not from datapath/wire: where the two disagree, the compliance suite
reports it. Every multi-byte field is big-endian (wire.md preamble). Section numbers in comments
and error strings are those of wire.md ("W§") and link.md ("L§").
"""
import socket
import struct

UDP_PORT = 4793                       # W§1, W§7
VERSION = 1                           # W§2.1
ETH_IPV4, ETH_ARP = 0x0800, 0x0806    # W§1
BASE_LEN, DATA_EXT_LEN, ACK_EXT_LEN, NAK_LEN, XRC_LEN = 32, 48, 48, 16, 4
DATA_HDRS = BASE_LEN + DATA_EXT_LEN   # 80: payload offset of a data packet (W§2.2)
SACK_BITS = 256                       # W§2.3, W§7
MAX_NAKS = 16                         # W§2.3

# Opcodes (W§2.2, W§2.3, W§2.5).
WRITE, WRITE_IMM, SEND, SEND_IMM, READ_REQ, READ_RESP, CMP_SWP, FETCH_ADD, SEND_INV = range(1, 10)
ACK, PROBE = 16, 17
DATAGRAM, DATAGRAM_IMM = 10, 11       # W§8: multicast datagrams, outside every connection
ATOMIC_WRITE = 12                     # W§2.2: 8 bytes stored whole, acknowledged as a WRITE
DATA_OPS = set(range(1, 10)) | {ATOMIC_WRITE}
DATAGRAM_OPS = {DATAGRAM, DATAGRAM_IMM}
MCAST_QPN = 0xffffff                  # W§8: a datagram's dst_stream
OP_NAMES = {WRITE: "WRITE", WRITE_IMM: "WRITE_IMM", SEND: "SEND", SEND_IMM: "SEND_IMM",
            READ_REQ: "READ_REQ", READ_RESP: "READ_RESP", CMP_SWP: "ATOMIC_CMP_SWP",
            FETCH_ADD: "ATOMIC_FETCH_ADD", SEND_INV: "SEND_INV", ATOMIC_WRITE: "ATOMIC_WRITE",
            DATAGRAM: "DATAGRAM",
            DATAGRAM_IMM: "DATAGRAM_IMM", ACK: "ACK", PROBE: "PROBE"}
# Opcodes whose rsn may be non-zero (W§2.2: SEND*, SEND_INV, WRITE_IMM).
RSN_OPS = {SEND, SEND_IMM, SEND_INV, WRITE_IMM}

# Flags (W§2.1).
F_FAILOVER, F_REDUNDANT, F_MORE, F_NOECHO, F_XRC = 0x8000, 0x4000, 0x2000, 0x1000, 0x0800
F_ORIG_PATH = 0x00ff

# NAK syndromes (W§2.4).
SYN_RNR, SYN_ACCESS, SYN_BOUNDS, SYN_INVALID, SYN_OPERATION, SYN_UNREACHABLE = 1, 2, 3, 4, 5, 7
SYN_NAMES = {1: "RNR", 2: "remote access", 3: "remote bounds", 4: "remote invalid",
             5: "remote operation", 7: "unreachable"}

_BASE = struct.Struct(">BBHIQHHIII")
_DATA = struct.Struct(">IIIIIIQIIII")
_ACK = struct.Struct(">I4QIHHI")
_NAK = struct.Struct(">IIIBBH")
assert _BASE.size == BASE_LEN and _DATA.size == DATA_EXT_LEN and _ACK.size == ACK_EXT_LEN
assert _NAK.size == NAK_LEN


def seq_lt(a, b):
    """a before b in a 32-bit sequence space (W§3.1: signed 32-bit difference)."""
    d = (a - b) & 0xffffffff
    return d >= 0x80000000


def seq_diff(a, b):
    d = (a - b) & 0xffffffff
    return d - (1 << 32) if d >= 0x80000000 else d


def ip_checksum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f">{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff


def mac_bytes(m):
    return bytes.fromhex(m.replace(":", "")) if isinstance(m, str) else bytes(m)


def mac_str(b):
    return ":".join(f"{x:02x}" for x in b)


# --- MRH -------------------------------------------------------------------------------------

class Mrh:
    """One MetaRoCE header set. Fields not given default to a valid value."""

    def __init__(self, **kw):
        self.version = VERSION
        self.opcode = WRITE
        self.flags = 0
        self.conn_id = 1
        self.token = 0
        self.path_id = 0
        self.path_count = 1
        self.path_seq = 0
        self.timestamp = 0
        self.ack_floor = 0
        # data extension
        self.dst_stream = self.src_stream = self.msn = self.rsn = 0
        self.offset = self.total_length = 0
        self.remote_addr = 0
        self.rkey = self.imm = 0
        self.payload_len = None       # None: len(payload)
        self.orig_seq = 0
        self.xrc_srqn = None
        self.payload = b""
        # ACK extension
        self.cum_seq = 0
        self.sack = 0                 # 256-bit integer, bit i = cum_seq + 1 + i
        self.echo_timestamp = 0
        self.ecn_ce_count = 0
        self.nak_count = None         # None: len(naks)
        self.rate_hint = 0
        self.naks = []                # [(path_seq, src_stream, msn, syndrome, rnr_timer, reserved)]
        self.__dict__.update(kw)

    def is_data(self):
        return self.opcode in DATA_OPS

    def is_datagram(self):
        return self.opcode in DATAGRAM_OPS

    def sacked(self):
        """Sequences the SACK names as received (W§2.3)."""
        return [(self.cum_seq + 1 + i) & 0xffffffff for i in range(SACK_BITS) if self.sack >> i & 1]

    def encode(self):
        b = _BASE.pack(self.version, self.opcode, self.flags, self.conn_id, self.token,
                       self.path_id, self.path_count, self.path_seq & 0xffffffff,
                       self.timestamp & 0xffffffff, self.ack_floor & 0xffffffff)
        if self.opcode == ACK:
            words = [(self.sack >> (64 * w)) & (2**64 - 1) for w in range(4)]
            b += _ACK.pack(self.cum_seq & 0xffffffff, *words, self.echo_timestamp & 0xffffffff,
                           self.ecn_ce_count,
                           len(self.naks) if self.nak_count is None else self.nak_count,
                           self.rate_hint)
            for n in self.naks:
                n = tuple(n) + (0,) * (6 - len(n))
                b += _NAK.pack(*n)
            return b
        if self.opcode == PROBE:
            return b
        plen = len(self.payload) if self.payload_len is None else self.payload_len
        b += _DATA.pack(self.dst_stream, self.src_stream, self.msn, self.rsn, self.offset,
                        self.total_length, self.remote_addr, self.rkey, self.imm, plen,
                        self.orig_seq)
        if self.xrc_srqn is not None:
            b += struct.pack(">I", self.xrc_srqn)
        return b + self.payload

    def __repr__(self):
        name = OP_NAMES.get(self.opcode, str(self.opcode))
        s = f"{name} conn={self.conn_id:#x} path={self.path_id}/{self.path_count} seq={self.path_seq}"
        if self.flags:
            s += f" flags={self.flags:#06x}"
        if self.is_data() or self.is_datagram():
            s += (f" stream {self.src_stream:#x}->{self.dst_stream:#x} msn={self.msn}"
                  f" off={self.offset}/{self.total_length} len={len(self.payload)}")
            if self.flags & F_FAILOVER:
                s += f" orig={self.flags & F_ORIG_PATH}:{self.orig_seq}"
        elif self.opcode == ACK:
            s += f" cum={self.cum_seq} sack={self.sacked()[:8]} hint={self.rate_hint}"
            if self.naks:
                s += f" naks={self.naks}"
        return s


def decode_mrh(b):
    """Decodes a UDP payload the way a strict receiver would. Returns (Mrh, problems): problems
    lists every way the packet breaks wire.md (empty when it conforms)."""
    bad = []
    if len(b) < BASE_LEN:
        return None, [f"{len(b)} bytes, shorter than the 32-byte base header (W§2.1)"]
    m = Mrh()
    (m.version, m.opcode, m.flags, m.conn_id, m.token, m.path_id, m.path_count, m.path_seq,
     m.timestamp, m.ack_floor) = _BASE.unpack_from(b)
    if m.version != VERSION:
        bad.append(f"version {m.version}, not 1 (W§2.1)")
    if m.opcode in DATAGRAM_OPS:
        return m, bad + _datagram(m, b)
    if m.conn_id == 0:
        bad.append("conn_id 0 (W§2.1)")
    if not 1 <= m.path_count <= 256:
        bad.append(f"path_count {m.path_count} outside 1..256 (W§2.1)")
    elif m.path_id >= m.path_count:
        bad.append(f"path_id {m.path_id} >= path_count {m.path_count} (W§2.1)")
    if m.opcode == ACK:
        if len(b) < BASE_LEN + ACK_EXT_LEN:
            return m, bad + [f"ACK of {len(b)} bytes, shorter than 80 (W§2.3)"]
        cum, w0, w1, w2, w3, m.echo_timestamp, m.ecn_ce_count, m.nak_count, m.rate_hint = \
            _ACK.unpack_from(b, BASE_LEN)
        m.cum_seq = cum
        m.sack = w0 | w1 << 64 | w2 << 128 | w3 << 192
        if m.flags & F_FAILOVER:
            bad.append("failover-copy flag on an ACK (W§2.1)")
        if m.flags & 0x07ff:
            bad.append(f"flags {m.flags:#06x}: undefined bits set (W§2.1: sender 0)")
        if m.path_seq != 0:
            bad.append(f"ACK path_seq {m.path_seq}, not 0 (W§2.1)")
        if m.ack_floor != 0:
            bad.append(f"ACK ack_floor {m.ack_floor}, not 0 (W§2.1)")
        if m.nak_count > MAX_NAKS:
            bad.append(f"nak_count {m.nak_count} > 16 (W§2.3)")
        want = BASE_LEN + ACK_EXT_LEN + NAK_LEN * m.nak_count
        if len(b) != want:
            bad.append(f"ACK of {len(b)} bytes with {m.nak_count} NAK records: must be {want} (W§2.3)")
        for i in range(min(m.nak_count, MAX_NAKS)):
            o = BASE_LEN + ACK_EXT_LEN + NAK_LEN * i
            if o + NAK_LEN > len(b):
                break
            n = _NAK.unpack_from(b, o)
            m.naks.append(n)
            seq, src, msn, syn, rnr, res = n
            if syn not in SYN_NAMES:
                bad.append(f"NAK syndrome {syn} undefined (W§2.4)")
            if syn == SYN_RNR and rnr != 0 and not (rnr & 0x80 and (rnr & 0x7f) <= 31):
                bad.append(f"RNR NAK rnr_timer {rnr:#x}: must be 0 or 0x80|0..31 (W§2.4)")
            if syn != SYN_RNR and rnr != 0:
                bad.append(f"NAK syndrome {syn} with rnr_timer {rnr:#x}: sender 0 (W§2.4)")
            if res != 0:
                bad.append(f"NAK reserved {res:#x}: sender 0 (W§2.4)")
        return m, bad
    if m.opcode == PROBE:
        if len(b) != BASE_LEN:
            bad.append(f"PROBE of {len(b)} bytes, not 32 (W§2.5)")
        if m.flags & F_FAILOVER:
            bad.append("failover-copy flag on a PROBE (W§2.1)")
        if m.flags & 0x07ff:
            bad.append(f"flags {m.flags:#06x}: undefined bits set (W§2.1: sender 0)")
        if seq_lt(m.path_seq, m.ack_floor):
            bad.append(f"ack_floor {m.ack_floor} above path_seq {m.path_seq} (W§2.1)")
        return m, bad
    if m.opcode not in DATA_OPS:
        return m, bad + [f"opcode {m.opcode} undefined (W§2.1)"]
    xrc = bool(m.flags & F_XRC) and m.opcode != READ_RESP
    hdrs = DATA_HDRS + (XRC_LEN if xrc else 0)
    if len(b) < hdrs:
        return m, bad + [f"data packet of {len(b)} bytes, shorter than its {hdrs} header bytes (W§2.2)"]
    (m.dst_stream, m.src_stream, m.msn, m.rsn, m.offset, m.total_length, m.remote_addr, m.rkey,
     m.imm, m.payload_len, m.orig_seq) = _DATA.unpack_from(b, BASE_LEN)
    if xrc:
        (m.xrc_srqn,) = struct.unpack_from(">I", b, DATA_HDRS)
    m.payload = bytes(b[hdrs:])
    if m.payload_len != len(m.payload):
        bad.append(f"payload_len {m.payload_len} but {len(m.payload)} payload bytes (W§2.2)")
    if m.rsn != 0 and m.opcode not in RSN_OPS:
        bad.append(f"rsn {m.rsn} on {OP_NAMES[m.opcode]} (W§2.2: MUST carry 0)")
    if m.offset + m.payload_len > m.total_length and m.opcode != READ_REQ:
        bad.append(f"offset {m.offset} + payload {m.payload_len} > total_length {m.total_length} (W§2.2)")
    if m.remote_addr + m.total_length > 2**64:
        bad.append("remote_addr + total_length wraps 2^64 (W§2.2)")
    sizes = {CMP_SWP: 16, FETCH_ADD: 16, ATOMIC_WRITE: 8}
    if m.opcode in sizes and (m.offset, m.total_length, m.payload_len) != (0, sizes[m.opcode], sizes[m.opcode]):
        bad.append(f"{OP_NAMES[m.opcode]} at offset {m.offset}, total_length {m.total_length}, "
                   f"payload_len {m.payload_len}: one packet of {sizes[m.opcode]} bytes (W§2.2)")
    if seq_lt(m.path_seq, m.ack_floor):
        bad.append(f"ack_floor {m.ack_floor} above path_seq {m.path_seq} (W§2.1)")
    if m.flags & F_FAILOVER and (m.flags & F_ORIG_PATH) >= m.path_count:
        bad.append(f"failover copy names path {m.flags & F_ORIG_PATH} >= path_count (W§2.1)")
    if m.flags & 0x0700 or (not m.flags & F_FAILOVER and m.flags & F_ORIG_PATH):
        bad.append(f"flags {m.flags:#06x}: undefined bits set (W§2.1: sender 0)")
    if not m.flags & F_FAILOVER and m.orig_seq != 0:
        bad.append(f"orig_seq {m.orig_seq} on a packet that is no failover copy (W§2.2: sender 0)")
    return m, bad


def _datagram(m, b):
    """The rest of a multicast datagram (W§8: the 80 bytes of a data packet, every connection
    field zero). Returns its problems."""
    bad = []
    if len(b) < DATA_HDRS:
        return [f"datagram of {len(b)} bytes, shorter than 80 (W§8)"]
    (m.dst_stream, m.src_stream, m.msn, m.rsn, m.offset, m.total_length, m.remote_addr, m.rkey,
     m.imm, m.payload_len, m.orig_seq) = _DATA.unpack_from(b, BASE_LEN)
    m.payload = bytes(b[DATA_HDRS:])
    for name in ("flags", "conn_id", "token", "path_id", "path_seq", "ack_floor", "rsn",
                 "offset", "remote_addr", "orig_seq"):
        if getattr(m, name) != 0:
            bad.append(f"datagram {name} {getattr(m, name):#x}, not 0 (W§8)")
    if m.path_count != 1:
        bad.append(f"datagram path_count {m.path_count}, not 1 (W§8)")
    if m.dst_stream != MCAST_QPN:
        bad.append(f"datagram dst_stream {m.dst_stream:#x}, not 0xffffff (W§8)")
    if m.src_stream >= 1 << 24:
        bad.append(f"datagram src_stream {m.src_stream:#x} not below 2^24 (W§8)")
    if m.payload_len != len(m.payload):
        bad.append(f"payload_len {m.payload_len} but {len(m.payload)} payload bytes (W§8)")
    if m.total_length != m.payload_len:
        bad.append(f"datagram total_length {m.total_length} != payload_len {m.payload_len} (W§8)")
    if m.opcode == DATAGRAM and m.imm != 0:
        bad.append(f"DATAGRAM (no immediate) with imm {m.imm:#x} (W§8)")
    return bad


def group_mac(ip):
    """The Ethernet address of an IPv4 group: 01:00:5e and its low 23 bits (RFC 1112, W§8)."""
    low = int.from_bytes(socket.inet_aton(ip), "big") & 0x7fffff
    return b"\x01\x00\x5e" + low.to_bytes(3, "big")


def is_group(ip):
    return 224 <= int(ip.split(".")[0]) <= 239


# --- Ethernet / IPv4 / UDP --------------------------------------------------------------------

def ipv4_udp(src_ip, dst_ip, sport, dport, payload, tos=0x02, ttl=64, df=True, ident=0,
             udp_len=None, ip_total=None, bad_ip_csum=False, frag=0, udp_csum=0, version_ihl=0x45):
    """An IPv4/UDP packet (L§1: DF, TTL 64, ECT(0), UDP checksum 0)."""
    ulen = 8 + len(payload) if udp_len is None else udp_len
    udp = struct.pack(">HHHH", sport, dport, ulen, udp_csum) + payload
    total = 20 + len(udp) if ip_total is None else ip_total
    flags_frag = (0x4000 if df else 0) | frag
    hdr = struct.pack(">BBHHHBBH4s4s", version_ihl, tos, total, ident, flags_frag, ttl, 17, 0,
                      socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    c = ip_checksum(hdr)
    if bad_ip_csum:
        c ^= 0x5a5a
    hdr = hdr[:10] + struct.pack(">H", c) + hdr[12:]
    return hdr + udp


def udp_checksum(src_ip, dst_ip, udp):
    pseudo = socket.inet_aton(src_ip) + socket.inet_aton(dst_ip) + struct.pack(">BBH", 0, 17, len(udp))
    c = ip_checksum(pseudo + udp)
    return c or 0xffff


# IGMPv2 (RFC 2236), which a device speaks for its groups (W§8, "Membership").
IGMP_QUERY, IGMP_REPORT, IGMP_LEAVE = 0x11, 0x16, 0x17
ALL_HOSTS, ALL_ROUTERS = "224.0.0.1", "224.0.0.2"
ROUTER_ALERT = b"\x94\x04\x00\x00"   # RFC 2113
DSCP_CS6 = 48


def igmp(kind, group, max_resp=100):
    """An IGMPv2 message: type, max response time (0.1 s units), checksum, group."""
    b = struct.pack(">BBH4s", kind, max_resp, 0, socket.inet_aton(group))
    return b[:2] + struct.pack(">H", ip_checksum(b)) + b[4:]


def ipv4_igmp(src_ip, dst_ip, msg):
    """IPv4 carrying IGMP as a host's stack sends it: TTL 1, Router Alert, DSCP CS6."""
    hdr = struct.pack(">BBHHHBBH4s4s", 0x46, DSCP_CS6 << 2, 24 + len(msg), 0, 0, 1, 2, 0,
                      socket.inet_aton(src_ip), socket.inet_aton(dst_ip)) + ROUTER_ALERT
    return hdr[:10] + struct.pack(">H", ip_checksum(hdr)) + hdr[12:] + msg


def ether(dst_mac, src_mac, etype, payload):
    f = mac_bytes(dst_mac) + mac_bytes(src_mac) + struct.pack(">H", etype) + payload
    return f + b"\0" * max(0, 60 - len(f))


def arp(op, src_mac, src_ip, dst_mac, dst_ip):
    """An ARP packet (W§1: htype 1, ptype 0x0800, hlen 6, plen 4)."""
    return struct.pack(">HHBBH6s4s6s4s", 1, ETH_IPV4, 6, 4, op, mac_bytes(src_mac),
                       socket.inet_aton(src_ip), mac_bytes(dst_mac), socket.inet_aton(dst_ip))


class Frame:
    """A received Ethernet frame, decoded. kind: 'arp', 'udp', 'mrh', 'igmp', 'other'."""

    def __init__(self, raw):
        self.raw = raw
        self.kind = "other"
        self.problems = []
        self.dst_mac, self.src_mac = raw[0:6], raw[6:12]
        self.etype = struct.unpack_from(">H", raw, 12)[0] if len(raw) >= 14 else 0
        if self.etype == ETH_ARP and len(raw) >= 14 + 28:
            (ht, pt, hl, pl, self.arp_op, sha, spa, tha, tpa) = struct.unpack_from(
                ">HHBBH6s4s6s4s", raw, 14)
            if (ht, pt, hl, pl) == (1, ETH_IPV4, 6, 4):
                self.kind = "arp"
                self.arp_sha, self.arp_tha = sha, tha
                self.arp_spa, self.arp_tpa = socket.inet_ntoa(spa), socket.inet_ntoa(tpa)
            return
        if self.etype != ETH_IPV4 or len(raw) < 14 + 20 + 8:
            return
        ip = raw[14:]
        vihl, self.tos, total, _, flags_frag, self.ttl, proto, _ = struct.unpack_from(">BBHHHBBH", ip)
        if proto == 2 and vihl >> 4 == 4:
            self._igmp(bytes(ip[:total]), (vihl & 15) * 4)
            return
        if proto != 17 or vihl >> 4 != 4:
            return
        ihl = (vihl & 15) * 4
        self.src_ip, self.dst_ip = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        self.sport, self.dport, ulen, self.udp_csum = struct.unpack_from(">HHHH", ip, ihl)
        self.df = bool(flags_frag & 0x4000)
        self.ecn = self.tos & 3
        if ihl != 20:
            self.problems.append(f"IPv4 IHL {ihl // 4}: we send 5 (W§1, L§1)")
        if ip_checksum(bytes(ip[:ihl])) != 0:
            self.problems.append("IPv4 header checksum wrong (W§1)")
        if not self.df or flags_frag & 0x3fff:
            self.problems.append(f"IPv4 flags/fragment {flags_frag:#06x}: DF set, no fragment (W§1)")
        if total > len(ip) or total < ihl + 8:
            self.problems.append(f"IPv4 total length {total} vs frame (W§1)")
            return
        if not 8 <= ulen <= total - ihl:
            self.problems.append(f"UDP length {ulen} vs IP payload {total - ihl} (W§1)")
            return
        udp = bytes(ip[ihl:ihl + ulen])
        if self.udp_csum != 0 and udp_checksum(self.src_ip, self.dst_ip,
                                               udp[:6] + b"\0\0" + udp[8:]) != self.udp_csum:
            self.problems.append("UDP checksum non-zero and wrong (W§1)")
        self.udp_payload = udp[8:]
        self.kind = "udp"
        if self.dport == UDP_PORT:
            self.mrh, probs = decode_mrh(self.udp_payload)
            self.problems += probs
            if self.mrh is not None:
                self.kind = "mrh"

    def _igmp(self, ip, ihl):
        """kind 'igmp': igmp_type, igmp_group, router_alert, ip_csum_ok, igmp_csum_ok."""
        if ihl < 20 or len(ip) < ihl + 8:
            return
        self.kind = "igmp"
        self.src_ip, self.dst_ip = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        self.router_alert = ROUTER_ALERT in ip[20:ihl]
        self.ip_csum_ok = ip_checksum(ip[:ihl]) == 0
        msg = ip[ihl:]
        self.igmp_csum_ok = ip_checksum(msg) == 0
        self.igmp_type, _, _, group = struct.unpack_from(">BBH4s", msg)
        self.igmp_group = socket.inet_ntoa(group)
