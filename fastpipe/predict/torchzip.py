"""A zip archive as torch writes one (torch.save checkpoints, torch.export's .pt2), checked before torch reads it.

Python's zipfile and torch's reader (miniz) find the central directory differently: zipfile takes the one that ends
where the end record begins and shifts every offset by whatever precedes it, miniz takes the end record's offset as
it is. An archive built with two central directories shows each reader another set of entries, so that a check made
through zipfile would pass what torch then loads. Torch itself writes one layout only: the entries from offset 0,
the central directory right after them, a zip64 end record and its locator, the end record, no comment. An archive
laid out so is read alike by both; every entry must also be stored uncompressed (as torch writes them) with sizes
within the archive's, so that no entry inflates to more than the file holds, whatever reads it.
"""

from __future__ import annotations

import io
import struct
import zipfile

END, END64, LOCATOR = 0x06054B50, 0x06064B50, 0x07064B50


class NotTorchsZip(ValueError):
    """A zip laid out otherwise than torch writes one."""


def stored_entries(f, size: int) -> list[zipfile.ZipInfo]:
    """The entries of the zip in the seekable binary file `f` of `size` bytes, once its layout is torch's; else
    NotTorchsZip naming what differs."""
    cd_offset, _, count = _directory(f, size)
    f.seek(0)
    infos = zipfile.ZipFile(f).infolist()
    if len(infos) != count:
        raise NotTorchsZip(f"{len(infos)} entries read, {count} in its end record")
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise NotTorchsZip(f"its entry {info.filename} is compressed ({info.file_size} bytes once inflated)")
        if info.header_offset + info.file_size > cd_offset:
            raise NotTorchsZip(f"its entry {info.filename} reaches past the entries' part of the file")
    if sum(i.file_size for i in infos) > cd_offset:
        raise NotTorchsZip("its entries add up to more than the file holds")
    return infos


def stored_entries_of(data: bytes) -> list[zipfile.ZipInfo]:
    return stored_entries(io.BytesIO(data), len(data))


def _directory(f, size: int) -> tuple[int, int, int]:
    """(offset, size, entries) of the central directory, from end records where torch puts them."""
    if size < 22:
        raise NotTorchsZip("too short for a zip archive")
    f.seek(size - 22)
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = struct.unpack("<IHHHHIIH", f.read(22))
    if sig != END or comment or disk or cd_disk or here != count:
        raise NotTorchsZip("its end record is not the file's last 22 bytes, or it has a comment or several disks")
    end = size - 22
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or count == 0xFFFF or _has_locator(f, size):
        end, cd_offset, cd_size, count = _zip64(f, size)
    if cd_offset + cd_size != end:
        raise NotTorchsZip("its central directory does not end where its end records begin (data before or "
                           "between them: another directory could be read by another reader)")
    return cd_offset, cd_size, count


def _has_locator(f, size: int) -> bool:
    if size < 42:
        return False
    f.seek(size - 42)
    return struct.unpack("<I", f.read(4))[0] == LOCATOR


def _zip64(f, size: int) -> tuple[int, int, int, int]:
    """(where the zip64 end record starts, directory offset, size, entries)."""
    if size < 98:
        raise NotTorchsZip("too short for a zip64 archive")
    f.seek(size - 42)
    sig, disk, where, disks = struct.unpack("<IIQI", f.read(20))
    if sig != LOCATOR or disk or disks != 1 or where != size - 42 - 56:
        raise NotTorchsZip("its zip64 locator is missing or points elsewhere than just before it")
    f.seek(where)
    sig, length, _, _, disk, cd_disk, here, count, cd_size, cd_offset = struct.unpack("<IQHHIIQQQQ", f.read(56))
    if sig != END64 or length != 44 or disk or cd_disk or here != count:
        raise NotTorchsZip("its zip64 end record is not the one torch writes")
    return where, cd_offset, cd_size, count
