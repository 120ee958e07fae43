#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The compliance suite's codec (mrwire.py) checked without an IUT: layouts at the offsets
wire.md gives, round trips, and every problem the decoder must report on frames made by hand.
A tester whose decoder passed anything would make the suite's checks of the IUT's frames
unable to fail."""
import os
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mrwire as w  # noqa: E402


def data(**kw):
    base = dict(opcode=w.WRITE, conn_id=0x11223344, token=0x0102030405060708, path_id=2,
                path_count=4, path_seq=9, timestamp=77, ack_floor=3, dst_stream=0x100,
                src_stream=0x200, msn=5, offset=64, total_length=128, remote_addr=0x1000,
                rkey=0x42, imm=0xabcd, payload=b"x" * 64)
    base.update(kw)
    return w.Mrh(**base)


class Layout(unittest.TestCase):
    def test_data_fields_sit_where_wire_md_puts_them(self):
        b = data().encode()
        self.assertEqual(len(b), 80 + 64)
        self.assertEqual(b[0], 1)                                       # version
        self.assertEqual(b[1], w.WRITE)                                 # opcode
        self.assertEqual(struct.unpack_from(">I", b, 4)[0], 0x11223344)  # conn_id
        self.assertEqual(struct.unpack_from(">Q", b, 8)[0], 0x0102030405060708)
        self.assertEqual(struct.unpack_from(">HH", b, 16), (2, 4))      # path_id, path_count
        self.assertEqual(struct.unpack_from(">III", b, 20), (9, 77, 3))
        self.assertEqual(struct.unpack_from(">IIII", b, 32), (0x100, 0x200, 5, 0))
        self.assertEqual(struct.unpack_from(">II", b, 48), (64, 128))   # offset, total_length
        self.assertEqual(struct.unpack_from(">Q", b, 56)[0], 0x1000)
        self.assertEqual(struct.unpack_from(">IIII", b, 64), (0x42, 0xabcd, 64, 0))

    def test_ack_sack_words_are_big_endian_lsb_first(self):
        m = w.Mrh(opcode=w.ACK, conn_id=1, cum_seq=10, sack=(1 << 0) | (1 << 65) | (1 << 255),
                  rate_hint=900, naks=[(11, 0x200, 5, w.SYN_BOUNDS, 0, 0)])
        b = m.encode()
        self.assertEqual(len(b), 80 + 16)
        self.assertEqual(struct.unpack_from(">QQQQ", b, 36), (1, 2, 0, 1 << 63))
        self.assertEqual(struct.unpack_from(">HHI", b, 72), (0, 1, 900))
        d, bad = w.decode_mrh(b)
        self.assertEqual(bad, [])
        self.assertEqual(d.sacked(), [11, 76, 266])
        self.assertEqual(d.naks, [(11, 0x200, 5, 3, 0, 0)])


class Problems(unittest.TestCase):
    def problems(self, m=None, raw=None):
        return w.decode_mrh(raw if raw is not None else m.encode())[1]

    def test_a_valid_packet_has_none(self):
        self.assertEqual(self.problems(data()), [])
        self.assertEqual(self.problems(w.Mrh(opcode=w.PROBE, conn_id=3, path_seq=4, ack_floor=4)), [])

    def test_each_bad_field_is_reported(self):
        cases = {
            "version": data(version=2),
            "conn_id": data(conn_id=0),
            "path_id": data(path_id=4),
            "path_count": data(path_count=0),
            "payload_len": data(payload_len=65),
            "rsn": data(rsn=1),
            "total_length": data(offset=100),
            "wraps": data(remote_addr=2**64 - 8),
            "ack_floor": data(ack_floor=10),
            "undefined bits": data(flags=0x0100),
            "orig_seq": data(orig_seq=4),
            "failover": data(flags=w.F_FAILOVER | 7),
            "opcode": data(opcode=12),
        }
        for what, m in cases.items():
            with self.subTest(what):
                self.assertTrue(self.problems(m), what)

    def test_bad_acks_and_probes_are_reported(self):
        ack = w.Mrh(opcode=w.ACK, conn_id=1)
        self.assertTrue(self.problems(raw=ack.encode() + b"\0"))                   # length
        self.assertTrue(self.problems(w.Mrh(opcode=w.ACK, conn_id=1, nak_count=17)))
        self.assertTrue(self.problems(w.Mrh(opcode=w.ACK, conn_id=1, naks=[(0, 0, 0, 6, 0, 0)])))
        self.assertTrue(self.problems(w.Mrh(opcode=w.ACK, conn_id=1, naks=[(0, 0, 0, 1, 0x40, 0)])))
        self.assertTrue(self.problems(w.Mrh(opcode=w.ACK, conn_id=1, path_seq=1)))
        self.assertTrue(self.problems(w.Mrh(opcode=w.ACK, conn_id=1, flags=w.F_FAILOVER)))
        self.assertTrue(self.problems(raw=w.Mrh(opcode=w.PROBE, conn_id=1).encode() + b"\0" * 4))
        self.assertTrue(self.problems(raw=b"\1" * 20))

    def test_datagrams_follow_their_own_table(self):
        def dg(**kw):
            base = dict(opcode=w.DATAGRAM, conn_id=0, path_count=1, dst_stream=w.MCAST_QPN,
                        src_stream=0x1234, msn=3, rkey=0x11, payload=b"y" * 10, total_length=10)
            base.update(kw)
            return w.Mrh(**base)
        self.assertEqual(self.problems(dg()), [])
        self.assertEqual(self.problems(dg(opcode=w.DATAGRAM_IMM, imm=5)), [])
        cases = {
            "conn_id": dg(conn_id=1), "token": dg(token=1), "flags": dg(flags=w.F_MORE),
            "path_id": dg(path_id=1, path_count=2), "path_count": dg(path_count=2),
            "path_seq": dg(path_seq=1), "ack_floor": dg(ack_floor=1), "rsn": dg(rsn=1),
            "offset": dg(offset=1), "remote_addr": dg(remote_addr=8), "orig_seq": dg(orig_seq=1),
            "dst_stream": dg(dst_stream=5), "src_stream": dg(src_stream=1 << 24),
            "total_length": dg(total_length=11), "payload_len": dg(payload_len=9),
            "imm without the opcode": dg(imm=5), "version": dg(version=0),
        }
        for what, m in cases.items():
            with self.subTest(what):
                self.assertTrue(self.problems(m), what)
        self.assertTrue(self.problems(raw=dg().encode()[:79]))
        self.assertEqual(w.group_mac("230.18.77.8"), bytes.fromhex("01005e124d08"))
        self.assertEqual(w.group_mac("239.255.0.1"), bytes.fromhex("01005e7f0001"))

    def test_frames_check_ip_and_udp(self):
        payload = data().encode()
        mac = "02:00:00:00:00:01"

        def frame(**kw):
            return w.Frame(w.ether(mac, mac, w.ETH_IPV4,
                                   w.ipv4_udp("198.18.0.1", "198.18.0.2", 50000, w.UDP_PORT,
                                              payload, **kw)))
        good = frame()
        self.assertEqual((good.kind, good.problems), ("mrh", []))
        self.assertEqual(good.ecn, 2)
        self.assertTrue(frame(bad_ip_csum=True).problems)
        self.assertTrue(frame(df=False).problems)
        self.assertTrue(frame(frag=0x2000).problems)
        self.assertTrue(frame(udp_len=6).problems)
        self.assertTrue(frame(udp_csum=0x1234).problems)
        udp = struct.pack(">HHHH", 50000, w.UDP_PORT, 8 + len(payload), 0) + payload
        right = w.udp_checksum("198.18.0.1", "198.18.0.2", udp)
        self.assertEqual(frame(udp_csum=right).problems, [])

    def test_igmp_is_decoded_and_checked(self):
        mac = "02:00:00:00:00:01"
        pkt = w.ipv4_igmp("198.18.0.1", "230.18.77.9", w.igmp(w.IGMP_REPORT, "230.18.77.9"))
        f = w.Frame(w.ether(w.group_mac("230.18.77.9"), mac, w.ETH_IPV4, pkt))
        self.assertEqual((f.kind, f.igmp_type, f.igmp_group, f.ttl, f.tos >> 2),
                         ("igmp", w.IGMP_REPORT, "230.18.77.9", 1, w.DSCP_CS6))
        self.assertTrue(f.router_alert and f.ip_csum_ok and f.igmp_csum_ok)
        # RFC 2236's example layout: type, max response time, checksum, group.
        self.assertEqual(w.igmp(w.IGMP_QUERY, "0.0.0.0", 100), bytes.fromhex("1164ee9b00000000"))
        bad = bytearray(pkt)
        bad[-1] ^= 1
        f = w.Frame(w.ether(mac, mac, w.ETH_IPV4, bytes(bad)))
        self.assertFalse(f.igmp_csum_ok)

    def test_sequences_compare_wrap_aware(self):
        self.assertTrue(w.seq_lt(0xfffffff0, 5))
        self.assertFalse(w.seq_lt(5, 0xfffffff0))
        self.assertEqual(w.seq_diff(3, 0xffffffff), 4)


if __name__ == "__main__":
    unittest.main()
