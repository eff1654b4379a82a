"""Build fix for the DeepGEMM peer copy (scripts/peer_deepgemm.sh), applied to .peer/DeepGEMM only.

Built with the H200 image's default g++ (which put a static libstdc++ into the extension), DeepGEMM's
first std::regex crashed (SIGSEGV in the bracket matcher's locale lookup, also with -Wl,-Bsymbolic);
its JIT runs one on every kernel's include list. The script now builds with the system g++; these
three regex uses stay replaced by plain string scans of the same meaning (not re-tested without).
Idempotent.
"""

import pathlib
import sys

root = pathlib.Path(sys.argv[1])
parser = root / "csrc/jit/include_parser.hpp"
text = parser.read_text()
if "const std::regex pattern" in text:
    old_scan = text[text.index("        const std::regex pattern"):text.index("        // TODO: parse relative paths")]
    new_scan = '''        // `#include <...>` / `#include "..."` lines, as the regex #\\s*include\\s*[<"][^>"]+[>"] found them
        std::vector<std::string> matches;
        for (size_t pos = code.find('#'); pos != std::string::npos; pos = code.find('#', pos + 1)) {
            size_t i = pos + 1;
            while (i < code.size() and std::isspace(static_cast<unsigned char>(code[i]))) ++ i;
            if (code.compare(i, 7, "include") != 0) continue;
            i += 7;
            while (i < code.size() and std::isspace(static_cast<unsigned char>(code[i]))) ++ i;
            if (i >= code.size() or (code[i] != '<' and code[i] != '"')) continue;
            const size_t close = code.find_first_of(">\\"", i + 1);
            if (close == std::string::npos or close == i + 1) continue;
            matches.push_back(code.substr(pos, close + 1 - pos));
        }
'''
    text = text.replace(old_scan, new_scan)
    text = text.replace("        for (; iter != end; ++ iter) {\n            const auto include_str = iter->str();",
                        "        for (const auto& include_str: matches) {")
    text = text.replace("#include <regex>\n", "#include <cctype>\n")
    parser.write_text(text)

compiler = root / "csrc/jit/compiler.hpp"
text = compiler.read_text()
text = text.replace('''        std::smatch match;
        DG_HOST_ASSERT(std::regex_search(output, match, std::regex(R"(release (\\d+\\.\\d+))")));
        std::sscanf(match[1].str().c_str(), "%d.%d", &major, &minor);''', '''        const auto release = output.find("release ");
        DG_HOST_ASSERT(release != std::string::npos);
        DG_HOST_ASSERT(std::sscanf(output.c_str() + release + 8, "%d.%d", &major, &minor) == 2);''')
text = text.replace('''DG_HOST_ASSERT(not std::regex_search(output, std::regex(R"(Local memory used)")));''',
                    '''DG_HOST_ASSERT(output.find("Local memory used") == std::string::npos);''')
compiler.write_text(text)
for path in (parser, compiler):
    if "std::regex" in path.read_text() or "sregex" in path.read_text():
        sys.exit(f"peer_deepgemm_patch: a regex is left in {path}")
