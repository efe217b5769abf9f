#!/usr/bin/env python3
"""Keep only the device code one GPU architecture needs in a CUDA shared library.

Rewrites every fatbin in the ELF section .nv_fatbin in place: entries kept
(ELF/SASS for the target arch; PTX with arch <= target only where a fatbin has
no SASS for the target; the smallest entry alone where a fatbin holds nothing
that runs on the target, as the original then does not either) are moved to the front, the fatbin header's size is
shrunk to them, and the rest of its region is zero-filled. The file keeps its
size and layout, so nothing else in the ELF changes; the zeros compress to
almost nothing. Usage: prune_fatbin.py IN.so OUT.so [ARCH=90]
"""
import struct
import sys

MAGIC = 0xBA55ED50


def section(data, name):
    shoff, = struct.unpack_from('<Q', data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3A)
    def sh(i):
        return struct.unpack_from('<IIQQQQIIQQ', data, shoff + i * shentsize)
    stroff = sh(shstrndx)[4]
    for i in range(shnum):
        h = sh(i)
        nm = data[stroff + h[0]: data.index(b'\0', stroff + h[0])].decode()
        if nm == name:
            return h[4], h[5]
    raise SystemExit(f'no section {name}')


def main():
    src, dst = sys.argv[1], sys.argv[2]
    arch = int(sys.argv[3]) if len(sys.argv) > 3 else 90
    with open(src, 'rb') as f:
        data = bytearray(f.read())
    off, size = section(data, '.nv_fatbin')
    p, end_sec = off, off + size
    nfat = kept_b = drop_b = 0
    ptx_only = unusable = 0
    while p + 16 <= end_sec:
        magic, ver, hs, fs = struct.unpack_from('<IHHQ', data, p)
        if magic != MAGIC:
            p += 8
            continue
        nfat += 1
        q, end = p + hs, p + hs + fs
        entries = []
        while q < end:
            kind, _, ehs, psize = struct.unpack_from('<HHIQ', data, q)
            a, = struct.unpack_from('<I', data, q + 28)
            entries.append((kind, a, q, ehs + psize))
            q += ehs + psize
        assert q == end, (hex(p), q, end)
        has_sass = any(k == 2 and a == arch for k, a, _, _ in entries)
        if has_sass:
            keep = [e for e in entries if e[0] == 2 and e[1] == arch]
        else:
            keep = [e for e in entries if e[0] == 1 and e[1] <= arch]
            if keep:
                ptx_only += 1
            else:  # nothing runs on this arch: keep one (the smallest) entry,
                # so the fatbin stays valid and as unusable as before
                keep = [min(entries, key=lambda e: e[3])]
                unusable += 1
        blob = b''.join(bytes(data[e[2]:e[2] + e[3]]) for e in keep)
        newfs = len(blob)
        kept_b += newfs
        drop_b += fs - newfs
        struct.pack_into('<Q', data, p + 8, newfs)
        data[p + hs:p + hs + newfs] = blob
        data[p + hs + newfs:end] = bytes(end - (p + hs + newfs))
        p = end
    with open(dst, 'wb') as f:
        f.write(data)
    print(f'{src}: {nfat} fatbins, kept {kept_b} B of device code for sm_{arch} '
          f'(fatbins kept as PTX for JIT: {ptx_only}, with no code for this arch: {unusable}), zeroed {drop_b} B')


if __name__ == '__main__':
    main()
