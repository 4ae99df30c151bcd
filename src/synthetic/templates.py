"""The synthetic families' chat templates: thinking and tool-call markup as each family's checkpoints ship it.

No MLX: `presets.py` puts them into its families.
"""

from __future__ import annotations

# Each follows its family's published template in structure and markup; dates and
# model identities are fixed strings so a rendering is reproducible.

_QWEN_TOOLS = (
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
)


#: Qwen2.5-VL's rendering of a content list: an image part as its vision markers (the processor
#: widens <|image_pad|> to the image's tokens), a text part as its text, in order.
_QWEN_VL_PARTS = (
    "{%- set parts = namespace(text='') %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or part.type == 'image_url' or 'image' in part %}"
    "{%- set parts.text = parts.text + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{%- elif part.type == 'text' %}{%- set parts.text = parts.text + part.text %}{%- endif %}"
    "{%- endfor %}{%- set content = parts.text %}"
)


def chatml_template(*, default_system: str | None, thinking: str | None, vision: bool = False) -> str:
    """Qwen ChatML with <tool_call> JSON; `thinking` None, "qwen3" (model opens <think>) or "qwen3.5";
    `vision`: a message's content may be a list of text and image parts (Qwen2.5-VL)."""
    if default_system is None:
        system_tools = "{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}" \
            "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
        system_plain = ""
    else:  # Qwen2.5 always has a system turn
        system_tools = "{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}" \
            "{{- messages[0].content }}{%- else %}{{- '" + default_system + "' }}{%- endif %}{{- '\\n\\n' }}"
        system_plain = "{%- else %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
    if thinking is None:
        assistant = "{{- '<|im_start|>' + message.role }}{%- if content %}{{- '\\n' + content }}{%- endif %}"
        call_sep = "{{- '\\n' }}"
        prompt = ""
    else:
        # As Qwen3: reasoning is kept only for turns after the last user query.
        assistant = (
            "{%- set reasoning = '' %}"
            "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
            "{%- elif '</think>' in content %}"
            "{%- set reasoning = content.split('</think>')[0].rstrip('\\n')"
            ".split('<think>')[-1].lstrip('\\n') %}"
            "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
            "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
            "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
            " + content.lstrip('\\n') }}"
            "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
        )
        call_sep = "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
        opened = "{%- else %}{{- '<think>\\n' }}" if thinking == "qwen3.5" else ""
        prompt = "{%- if enable_thinking is defined and enable_thinking is false %}" \
            "{{- '<think>\\n\\n</think>\\n\\n' }}" + opened + "{%- endif %}"
    return (
        "{%- if tools %}" + system_tools + _QWEN_TOOLS +
        "{%- elif messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}" + system_plain +
        "{%- endif %}"
        "{%- set ns = namespace(multi_step_tool=true, last_query=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
        " and not message.content.startswith('<tool_response>') %}"
        "{%- set ns.multi_step_tool = false %}{%- set ns.last_query = index %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}"
        "{%- set content = message.content if message.content is string else '' %}"
        + ("{%- if message.content is not string and message.content %}" + _QWEN_VL_PARTS + "{%- endif %}"
           if vision else "") +
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}" + assistant +
        "{%- for tool_call in message.tool_calls or [] %}" + call_sep +
        "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
        "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        "{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + prompt + "{%- endif %}"
    )


# Llama 3.1 Instruct: header turns, tools as JSON in the first user turn, results as "ipython".
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- if tools and messages %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\nRespond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- messages[0].content | trim + '<|eot_id|>' }}{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}{%- set call = message.tool_calls[0] %}"
    "{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call.name + '\", "
    "\"parameters\": ' }}{{- call.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- message.content | tojson }}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
    " + message.content | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 3: turns of user/model, the system text prefixed to the first user turn. Gemma 3 has no
# tool tokens; tools follow Google's prompt recipe (```tool_code``` calls, ```tool_output``` results).
GEMMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(prefix='') %}"
    "{%- if messages[0].role == 'system' %}{%- set ns.prefix = messages[0].content + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if tools %}{%- set ns.prefix = ns.prefix + 'You have access to functions. If you decide to "
    "invoke any of the function(s), you MUST put it in the format of\\n```tool_code\\n"
    "function_name(param=value)\\n```\\n"
    "You SHOULD NOT include any other text in the response if you call a function\\n' %}"
    "{%- for t in tools %}{%- set ns.prefix = ns.prefix + (t | tojson) + '\\n' %}{%- endfor %}"
    "{%- set ns.prefix = ns.prefix + '\\n' %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message.role == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + (ns.prefix if loop.first else '') }}"
    "{%- if message.role == 'tool' %}{{- '```tool_output\\n' + message.content + '\\n```' }}"
    "{%- else %}{{- (message.content or '') | trim }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}{%- if call.function %}{%- set call = call.function %}"
    "{%- endif %}{{- '```tool_code\\n' + call.name + '(' }}"
    "{%- for k, v in call.arguments.items() %}{{- k + '=' }}{{- v | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ')\\n```' }}{%- endfor %}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Gemma 3 with its vision tower: an image part is <start_of_image> (the processor widens it to the image's
# soft tokens), a text part its text.
GEMMA3_VL_TEMPLATE = GEMMA3_TEMPLATE.replace(
    "{%- else %}{{- (message.content or '') | trim }}{%- endif %}",
    "{%- elif message.content is not string and message.content %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or part.type == 'image_url' %}{{- '<start_of_image>' }}"
    "{%- elif part.type == 'text' %}{{- part.text | trim }}{%- endif %}{%- endfor %}"
    "{%- else %}{{- (message.content or '') | trim }}{%- endif %}")

# gpt-oss harmony: system/developer/user turns, assistant analysis/commentary/final channels,
# tool calls to=functions.NAME ending in <|call|>, tools as a TypeScript-like namespace.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: ' + (reasoning_effort | default('medium')) + '\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}"
    "{%- endif %}{{- '<|end|>' }}"
    "{%- if messages[0].role in ('system', 'developer') %}{%- set instructions = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set instructions = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- if instructions or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{- '# Instructions\\n\\n' + instructions }}{%- endif %}"
    "{%- if instructions and tools %}{{- '\\n\\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}"
    "{{- '// ' + (f.description or '') + '\\ntype ' + f.name + ' = (_: ' }}"
    "{{- (f.parameters or {}) | tojson }}{{- ') => any;\\n\\n' }}{%- endfor %}"
    "{{- '} // namespace functions' }}{%- endif %}{{- '<|end|>' }}{%- endif %}"
    "{%- set ns = namespace(last_call='') %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- if message.tool_calls %}"
    "{%- if message.thinking or message.reasoning_content %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>'"
    " + (message.thinking or message.reasoning_content) + '<|end|>' }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{%- set ns.last_call = call.name %}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name"
    " + ' <|constrain|>json<|message|>' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}"
    "{%- endif %}{{- '<|call|>' }}{%- endfor %}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + (message.name or ns.last_call) + ' to=assistant<|channel|>commentary"
    "<|message|>' + message.content + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
