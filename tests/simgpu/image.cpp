/* Module images: CUBIN (an ELF whose e_flags hold the SM version: the low byte up to ELF ABI
 * version 7, NVRTC 12's; the second byte from version 8, NVRTC 13's; with a .nv.info.<kernel>
 * section per kernel holding EIATTR_KPARAM_INFO and EIATTR_MAX_THREADS records) or PTX text
 * (`.target sm_XY`, `.entry name(.param ...)`, `.maxntid`). */
#include "image.h"

#include <elf.h>

#include <cstdint>
#include <cstring>
#include <regex>

namespace sim {
namespace {

constexpr uint8_t kFormatSval = 0x04;
constexpr uint8_t kAttrMaxThreads = 0x05;
constexpr uint8_t kAttrParamInfo = 0x17;

bool parse_cubin(const uint8_t *d, Image *image, std::string *why) {
    Elf64_Ehdr h;
    memcpy(&h, d, sizeof h);
    if (h.e_ident[EI_CLASS] != ELFCLASS64 || h.e_shentsize != sizeof(Elf64_Shdr)) {
        *why = "not a 64-bit CUBIN";
        return false;
    }
    image->cubin = true;
    image->arch = (int)(h.e_ident[EI_ABIVERSION] >= 8 ? (h.e_flags >> 8) & 0xff : h.e_flags & 0xff);
    std::vector<Elf64_Shdr> sections(h.e_shnum);
    memcpy(sections.data(), d + h.e_shoff, h.e_shnum * sizeof(Elf64_Shdr));
    const char *names = (const char *)d + sections[h.e_shstrndx].sh_offset;
    const std::string prefix = ".nv.info.";
    for (const auto &s : sections) {
        std::string name = names + s.sh_name;
        if (name.compare(0, prefix.size(), prefix) != 0) continue;
        ImageKernel &k = image->kernels[name.substr(prefix.size())];
        std::map<unsigned, size_t> params; /* ordinal -> size */
        const uint8_t *p = d + s.sh_offset, *end = p + s.sh_size;
        while (p + 4 <= end) {
            uint8_t format = p[0], attr = p[1];
            uint16_t size;
            memcpy(&size, p + 2, 2);
            if (format != kFormatSval) {
                p += 4;
                continue;
            }
            const uint8_t *value = p + 4;
            if (attr == kAttrParamInfo && size >= 12) {
                uint16_t ordinal;
                uint32_t word;
                memcpy(&ordinal, value + 4, 2);
                memcpy(&word, value + 8, 4);
                params[ordinal] = word >> 18;
            } else if (attr == kAttrMaxThreads && size >= 12) {
                uint32_t xyz[3];
                memcpy(xyz, value, 12);
                k.max_threads = xyz[0] * xyz[1] * xyz[2];
            }
            p += 4 + size;
        }
        for (auto &[ordinal, size] : params) {
            if (ordinal != k.param_sizes.size()) {
                *why = "kernel " + name + " has a gap in its parameter list";
                return false;
            }
            k.param_sizes.push_back(size);
        }
    }
    return true;
}

size_t ptx_type_size(const std::string &t) {
    if (t == "u64" || t == "s64" || t == "b64" || t == "f64") return 8;
    if (t == "u32" || t == "s32" || t == "b32" || t == "f32") return 4;
    if (t == "u16" || t == "s16" || t == "b16" || t == "f16") return 2;
    return 1;
}

bool parse_ptx(const char *text, Image *image, std::string *why) {
    std::string ptx(text);
    std::smatch m;
    if (!std::regex_search(ptx, m, std::regex(R"(\.target\s+sm_(\d+))"))) {
        *why = "PTX without a .target";
        return false;
    }
    image->arch = std::stoi(m[1]);
    std::regex entry(R"(\.entry\s+(\w+)\s*\(([^)]*)\)([^{]*))");
    std::regex param(R"(\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(?:\[(\d+)\])?)");
    std::regex maxntid(R"(\.maxntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+))");
    for (auto it = std::sregex_iterator(ptx.begin(), ptx.end(), entry); it != std::sregex_iterator(); ++it) {
        ImageKernel &k = image->kernels[(*it)[1]];
        std::string params = (*it)[2], tail = (*it)[3];
        for (auto p = std::sregex_iterator(params.begin(), params.end(), param); p != std::sregex_iterator(); ++p)
            k.param_sizes.push_back((*p)[2].matched ? std::stoul((*p)[2]) * ptx_type_size((*p)[1]) : ptx_type_size((*p)[1]));
        std::smatch n;
        if (std::regex_search(tail, n, maxntid)) k.max_threads = std::stoul(n[1]) * std::stoul(n[2]) * std::stoul(n[3]);
    }
    return true;
}

} // namespace

bool parse_image(const void *data, Image *image, std::string *why) {
    const auto *d = static_cast<const uint8_t *>(data);
    if (!d) {
        *why = "null image";
        return false;
    }
    if (memcmp(d, ELFMAG, SELFMAG) == 0) return parse_cubin(d, image, why);
    if (strstr((const char *)d, ".version") && strstr((const char *)d, ".target")) return parse_ptx((const char *)d, image, why);
    *why = "neither CUBIN nor PTX";
    return false;
}

} // namespace sim
