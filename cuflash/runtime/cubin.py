"""Cubins, the ELF images NVRTC makes: target arch names, which device may load which image,
and reading the arch back from an image's ELF header.

An arch is written ``sm_<major><minor>`` with an optional suffix: ``sm_90`` runs on every device
of compute capability 9.x (the same major, minor at least 0), ``sm_90a`` (architecture-specific
features: ``wgmma``, ``setmaxnreg``) on compute capability 9.0 only (CUDA C++ Programming Guide,
"Feature Availability": an ``a`` target is neither forward- nor backward-compatible). The
suffix ``f`` (family-specific, CUDA 12.9+) is not used by cuflash.
"""

from __future__ import annotations

import re
import struct

_ARCH = re.compile(r"(?:sm_)?(\d{2,3})(a?)")

#: EM_CUDA, the ELF machine number of NVIDIA GPU code (System V gABI machine table)
EM_CUDA = 190


def parse_arch(arch) -> tuple[int, str]:
    """``(cc, suffix)`` of an arch: ``90 -> (90, "")``, ``"90a"`` or ``"sm_90a" -> (90, "a")``.

    Raises
    ------
    TypeError
        If ``arch`` is neither an int nor a str.
    ValueError
        If it is not a compute capability such as ``80``, ``"90"``, ``"90a"`` or ``"sm_90a"``.
    """
    if isinstance(arch, bool) or not isinstance(arch, (int, str)):
        raise TypeError(f"cuflash: arch={arch!r} must be an int such as 80 or a str such as '90a', "
                        f"not {type(arch).__name__}")
    m = _ARCH.fullmatch(str(arch).strip())
    if m is None or int(m.group(1)) < 10:
        raise ValueError(f"cuflash: arch={arch!r} must be a compute capability such as 80, '90', '90a' or 'sm_90a'")
    return int(m.group(1)), m.group(2)


def arch_name(arch) -> str:
    """The ``-arch`` value of an arch: ``90 -> "sm_90"``, ``"90a" -> "sm_90a"`` (see :func:`parse_arch`)."""
    cc, suffix = parse_arch(arch)
    return f"sm_{cc}{suffix}"


def _family(cc: int) -> str:
    return {7: " (Volta/Turing)", 8: " (Ampere/Ada)", 9: " (Hopper)", 10: " (Blackwell)", 11: " (Blackwell)",
            12: " (Blackwell)"}.get(cc // 10, "")


def arch_reason(arch, cc: int) -> str | None:
    """Why code for ``arch`` cannot run on a device of compute capability ``cc`` (``90`` for 9.0),
    or None if it can.

    ``sm_XY`` SASS runs on compute capability X.Z for Z >= Y (binary compatibility within a
    major); ``sm_XYa`` on X.Y only. Examples: ``arch_reason("90a", 100)`` says that sm_90a code
    runs on compute capability 9.0 only (Blackwell, 10.0, gets the tensor-core tier);
    ``arch_reason(80, 86)`` is None.
    """
    want, suffix = parse_arch(arch)
    name = f"sm_{want}{suffix}"
    if suffix == "a":
        if cc != want:
            return (f"{name} code (wgmma, setmaxnreg) runs on compute capability {want // 10}.{want % 10} only, "
                    f"not on {cc // 10}.{cc % 10}{_family(cc)}")
        return None
    if cc // 10 != want // 10 or cc < want:
        return f"{name} code runs on compute capability {want // 10}.x with x >= {want % 10}, not on {cc // 10}.{cc % 10}"
    return None


def complete_elf(cubin: bytes) -> bytes:
    """``cubin`` padded with zero bytes to the end its ELF header declares.

    CuPy 14's ``nvrtc.getCUBIN`` returns one byte less than ``nvrtcGetCUBINSize`` (it drops the
    last byte, a 0, as if the image were a C string); the driver loads the short image, but
    ``cuobjdump`` and ``nvdisasm`` reject it ("does not contain device code"). The ELF-64 header
    (System V gABI, e_phoff/e_shoff at 0x20, entry sizes and counts at 0x36) says where the file
    ends: after the program or the section header table, whichever is last.
    """
    if len(cubin) < 0x40 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return cubin  # not a 64-bit ELF image: left as it is
    end = _declared_end(cubin)
    return cubin + b"\0" * max(0, end - len(cubin))


def _declared_end(image: bytes) -> int:
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def _section(image: bytes, wanted: str) -> bytes | None:
    """The bytes of the section named ``wanted`` (ELF-64 section headers, gABI), or None."""
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    if not shoff or shstrndx >= shnum or shoff + shentsize * shnum > len(image):
        return None

    def header(i):  # sh_name, sh_offset, sh_size
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", image, base)
        offset, size = struct.unpack_from("<QQ", image, base + 0x18)
        return name, offset, size

    _, str_off, str_size = header(shstrndx)
    names = image[str_off:str_off + str_size]
    for i in range(shnum):
        name, offset, size = header(i)
        end = names.find(b"\0", name)
        if names[name:end if end >= 0 else None] == wanted.encode():
            return image[offset:offset + size]
    return None


def _compat_arch_specific(section: bytes) -> bool:
    """Whether the ``.nv.compat`` attributes of a CUDA 13 image mark it ``a`` (attribute 0x09 = 1).

    Records as in ``.nv.info``: a format byte, an attribute byte, then a 2-byte value (formats 1-3)
    or a 2-byte size and that many bytes (format 4).
    """
    pos = 0
    while pos + 4 <= len(section):
        fmt, attr = section[pos], section[pos + 1]
        if fmt in (1, 2, 3):
            if attr == 0x09:
                return section[pos + 2] == 1
            pos += 4
        elif fmt == 4:
            size, = struct.unpack_from("<H", section, pos + 2)
            pos += 4 + size
        else:
            return False
    return False


def cubin_arch(cubin: bytes) -> str:
    """The target arch of a cubin, as ``cuobjdump --list-elf`` names it (``"sm_80"``, ``"sm_90a"``).

    Read from the ELF header (e_machine EM_CUDA; EI_ABIVERSION at byte 8, e_flags at 0x30),
    as measured on NVRTC 12.9 and 13.5 images against ``cuobjdump --list-elf``:

    * ABI version 7 and older (NVRTC 12.x up to sm_90): e_flags bits 0-7 hold the SM
      (bits 16-23 the virtual arch), bit 0x800 the ``a`` suffix;
    * ABI version 8 (NVRTC 12.x for sm_100+, NVRTC 13.x for all): bits 8-15 hold the SM and bit
      0x8 the ``a`` suffix (12.x); NVRTC 13.x leaves that bit clear and marks ``a`` with
      attribute 0x09 = 1 in the ``.nv.compat`` section.

    Raises
    ------
    ValueError
        If ``cubin`` is not a 64-bit little-endian ELF image of GPU code.
    """
    if len(cubin) < 0x40 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError(f"cuflash.cubin_arch: cubin must be a 64-bit little-endian ELF image; got {bytes(cubin[:8])!r}")
    machine, = struct.unpack_from("<H", cubin, 0x12)
    if machine != EM_CUDA:
        raise ValueError(f"cuflash.cubin_arch: cubin must have e_machine {EM_CUDA} (EM_CUDA); got {machine}")
    abi = cubin[8]
    flags, = struct.unpack_from("<I", cubin, 0x30)
    if abi < 8:
        sm, specific = flags & 0xFF, bool(flags & 0x800)
    else:
        sm, specific = (flags >> 8) & 0xFF, bool(flags & 0x8)
        if not specific:
            compat = _section(cubin, ".nv.compat")
            specific = compat is not None and _compat_arch_specific(compat)
    return f"sm_{sm}{'a' if specific else ''}"
